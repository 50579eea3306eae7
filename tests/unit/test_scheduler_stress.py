"""Randomized scheduler runs: groups, shared prefixes, drafts, aborts and a small KV pool."""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import pytest

from rollout_engine.core.request import Request, RequestStatus
from rollout_engine.core.scheduler import Scheduler
from rollout_engine.core.scheduler_output import SchedulerOutput
from tests.unit.factories import (
    FakeModelRunner,
    check_ledger_invariants,
    fresh_token_ids,
    logprob_for,
    make_group,
    make_scheduler,
)

EOS = 2
VOCAB_START, VOCAB_SIZE = 1000, 400
WRONG_DRAFT = 999  # never produced by the stand-in model


def stress_token(request_id: str, position: int) -> int:
    """The stand-in model's token: a fixed function of (request, position); EOS about 2%."""
    x = zlib.crc32(f"{request_id}@{position}".encode())
    return EOS if x % 53 == 0 else VOCAB_START + x % VOCAB_SIZE


@dataclass(frozen=True)
class StressConfig:
    num_groups: int
    max_num_batched_tokens: int = 32
    max_num_seqs: int = 16
    max_model_len: int = 96
    block_size: int = 4
    num_blocks: int = 40
    num_speculative_tokens: int = 3
    enable_prefix_caching: bool = True
    max_n: int = 4
    arrival_prob: float = 0.5
    max_num_waiting: int = 12
    abort_prob: float = 0.02
    draft_prob: float = 0.6


@dataclass
class StressStats:
    num_steps: int = 0
    num_requests: int = 0
    num_preemptions: int = 0
    num_hit_tokens: int = 0
    num_aborted: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)


def expected_completion(request: Request, max_model_len: int) -> tuple[list[int], str]:
    """What the request must generate: stand-in tokens up to the first stop condition."""
    params = request.sampling_params
    tokens: list[int] = []
    while True:
        token = stress_token(request.request_id, request.num_prompt_tokens + len(tokens))
        tokens.append(token)
        if token in params.stop_token_ids or (token == EOS and not params.ignore_eos):
            return tokens, "stop"
        if (
            len(tokens) >= params.max_tokens
            or request.num_prompt_tokens + len(tokens) >= max_model_len
        ):
            return tokens, "length"


class StressRun:
    """Drives one scheduler with random arrivals, drafts and aborts, checking every step."""

    async_scheduling = False

    def __init__(self, seed: int, config: StressConfig) -> None:
        self.rng = random.Random(seed)
        self.config = config
        self.scheduler: Scheduler = make_scheduler(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            num_speculative_tokens=config.num_speculative_tokens,
            eos_token_ids=[EOS],
            async_scheduling=self.async_scheduling,
        )
        self.runner = FakeModelRunner(self.scheduler, token_fn=stress_token)
        self.prefixes = [fresh_token_ids(self.rng.randint(4, 24)) for _ in range(4)]
        self.requests: dict[str, Request] = {}
        self.aborted_ids: set[str] = set()
        self.stats = StressStats()
        self._seed = seed

    def run(self) -> StressStats:
        num_groups_added = 0
        while num_groups_added < self.config.num_groups or self._has_work():
            while num_groups_added < self.config.num_groups and self._arrives():
                self._add_group(f"s{self._seed}-g{num_groups_added}")
                num_groups_added += 1
            self._step()
            assert self.stats.num_steps < 50 * self.config.num_groups + 1000, "no progress"
        self._check_final()
        return self.stats

    def _has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _arrives(self) -> bool:
        """Random arrivals, held back while the queue is long (keeps each step cheap)."""
        num_waiting = len(self.scheduler.waiting)
        return (
            num_waiting < self.config.max_num_waiting
            and self.rng.random() < self.config.arrival_prob
        )

    def _add_group(self, group_id: str) -> None:
        rng, config = self.rng, self.config
        if rng.random() < 0.5:
            prompt = rng.choice(self.prefixes) + fresh_token_ids(rng.randint(0, 20))
        else:
            prompt = fresh_token_ids(rng.randint(1, 48))
        stop_token_ids = (
            [rng.randrange(VOCAB_START, VOCAB_START + VOCAB_SIZE)] if rng.random() < 0.2 else []
        )
        group = make_group(
            group_id,
            rng.randint(1, config.max_n),
            prompt,
            max_tokens=rng.randint(1, 48),
            ignore_eos=rng.random() < 0.1,
            stop_token_ids=stop_token_ids,
        )
        for request in group:
            self.scheduler.add_request(request)
            self.requests[request.request_id] = request
        self.stats.num_requests += len(group)

    def _abort_random(self) -> None:
        live_ids = list(self.scheduler.requests)
        if not live_ids:
            return
        victim = self.requests[self.rng.choice(live_ids)]
        if self.rng.random() < 0.3:  # the whole group, as the engine aborts a prompt
            ids = [rid for rid in live_ids if self.requests[rid].group_id == victim.group_id]
        else:
            ids = [victim.request_id]
        self.aborted_ids.update(ids)
        self.scheduler.finish_requests(ids)

    def _step(self) -> None:
        scheduler, rng = self.scheduler, self.rng
        if rng.random() < self.config.abort_prob:
            self._abort_random()
        running_before = {r.request_id for r in scheduler.running}
        waiting_before = {r.request_id for r in scheduler.waiting}
        output = scheduler.schedule()
        self._check_output(output, running_before, waiting_before)
        runner_output = self.runner.execute(output)
        if rng.random() < self.config.abort_prob / 2:
            self._abort_random()  # arrives while the model runs
        updated = scheduler.update_from_output(output, runner_output)
        for request in updated:
            assert set(runner_output.sampled_token_ids) >= {request.request_id}
            if not request.is_finished:
                assert request.num_tokens - request.num_computed_tokens == 1, request
        check_ledger_invariants(scheduler)
        self._propose_drafts()
        self.stats.num_steps += 1

    def _check_output(
        self, output: SchedulerOutput, running_before: set[str], waiting_before: set[str]
    ) -> None:
        config, scheduler = self.config, self.scheduler
        budget, k = config.max_num_batched_tokens, config.num_speculative_tokens
        scheduled_ids = [s.request_id for s in output.scheduled_requests]
        if running_before or waiting_before:
            assert output.total_num_scheduled_tokens > 0 or output.preempted_request_ids, "stalled"
        assert len(set(scheduled_ids)) == len(scheduled_ids)
        assert output.total_num_scheduled_tokens == sum(output.num_scheduled_tokens.values())
        assert output.total_num_scheduled_tokens <= budget
        assert set(output.num_scheduled_tokens) == set(scheduled_ids)
        for scheduled in output.scheduled_requests:
            num_new = output.num_scheduled_tokens[scheduled.request_id]
            assert 1 <= num_new <= budget - k
            assert scheduled.num_spec_tokens <= k
            assert scheduled.start_position + num_new <= config.max_model_len
            drafts = output.scheduled_spec_decode_tokens.get(scheduled.request_id, [])
            assert len(drafts) == scheduled.num_spec_tokens
            if scheduled.request_id in waiting_before:
                self.stats.num_hit_tokens += scheduled.start_position
        preempted = set(output.preempted_request_ids)
        self.stats.num_preemptions += len(preempted)
        assert preempted <= running_before and not preempted & set(scheduled_ids)
        for request_id in preempted:
            request = self.requests[request_id]
            assert request.status is RequestStatus.PREEMPTED and request.num_computed_tokens == 0
        if preempted:
            assert set(scheduled_ids) <= running_before, "admitted a request in a preempting step"
            waiting_ids = [r.request_id for r in scheduler.waiting]
            assert set(waiting_ids[: len(preempted)]) == preempted, "preempted not at the front"

    def _propose_drafts(self) -> None:
        k = self.config.num_speculative_tokens
        for request in self.scheduler.running:
            if k == 0 or request.num_computed_tokens != request.num_tokens - 1:
                continue
            if self.rng.random() >= self.config.draft_prob:
                continue
            num_drafts = self.rng.randint(1, k)
            request.spec_token_ids = [
                stress_token(request.request_id, request.num_tokens + i)
                if self.rng.random() < 0.7
                else WRONG_DRAFT
                for i in range(num_drafts)
            ]

    def _check_final(self) -> None:
        scheduler, stats = self.scheduler, self.stats
        kv = scheduler.kv_cache_manager
        assert not scheduler.running and not scheduler.waiting and not scheduler.requests
        assert kv.num_free_blocks == kv.num_blocks
        check_ledger_invariants(scheduler)
        for request in self.requests.values():
            assert request.status is RequestStatus.FINISHED, request
            expected, reason = expected_completion(request, self.config.max_model_len)
            num_prompt_tokens = request.num_prompt_tokens
            assert request.output_logprobs == [
                logprob_for(num_prompt_tokens + i) for i in range(request.num_output_tokens)
            ]
            if request.finish_reason == "abort":
                assert request.request_id in self.aborted_ids
                assert request.output_token_ids == expected[: request.num_output_tokens]
                assert request.num_output_tokens < len(expected)
                stats.num_aborted += 1
            else:
                assert (request.output_token_ids, request.finish_reason) == (expected, reason), (
                    f"{request.request_id}: got {request.num_output_tokens} tokens "
                    f"({request.finish_reason}), expected {len(expected)} ({reason})"
                )
            stats.finish_reasons[request.finish_reason] = (
                stats.finish_reasons.get(request.finish_reason, 0) + 1
            )


def assert_run_was_eventful(
    stats: StressStats, runner: FakeModelRunner, config: StressConfig
) -> None:
    """Guards against a stress run that silently stopped exercising the hard paths."""
    assert stats.num_preemptions >= 20, stats
    assert stats.num_aborted >= 5, stats
    assert set(stats.finish_reasons) == {"stop", "length", "abort"}, stats
    if config.enable_prefix_caching:
        assert stats.num_hit_tokens > 0, stats
    if config.num_speculative_tokens:
        assert 0 < runner.num_drafts_accepted < runner.num_drafts_scheduled


STRESS_CONFIGS = {
    "drafts": StressConfig(num_groups=250),
    "no-drafts": StressConfig(
        num_groups=250, num_speculative_tokens=0, block_size=8, num_blocks=24
    ),
    "tight": StressConfig(
        num_groups=200, max_num_batched_tokens=24, num_blocks=28, max_num_seqs=8, max_n=6
    ),
    "no-caching": StressConfig(
        num_groups=200, enable_prefix_caching=False, num_speculative_tokens=2
    ),
    # A pool barely larger than the longest request (64 positions): preemption on most steps.
    "minimal-pool": StressConfig(num_groups=150, max_model_len=64, num_blocks=17),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(STRESS_CONFIGS))
def test_random_workload_keeps_the_ledger_consistent(name: str, seed: int) -> None:
    config = STRESS_CONFIGS[name]
    run = StressRun(seed, config)
    stats = run.run()
    assert_run_was_eventful(stats, run.runner, config)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10, 16))
def test_random_workload_keeps_the_ledger_consistent_long(seed: int) -> None:
    config = StressConfig(
        num_groups=1500,
        max_num_seqs=24,
        num_blocks=48,
        max_model_len=128,
        max_n=8,
        num_speculative_tokens=1 + seed % 4,
    )
    run = StressRun(seed, config)
    stats = run.run()
    assert_run_was_eventful(stats, run.runner, config)
