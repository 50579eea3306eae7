"""Builders for ledger-level tests: schedulers, requests, and a stand-in model runner."""

from __future__ import annotations

import dataclasses
import itertools
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence

from rollout_engine.config import CacheConfig, RuntimeLimits, SchedulerConfig, SpeculativeConfig
from rollout_engine.core.request import Request, RequestStatus
from rollout_engine.core.scheduler import Scheduler
from rollout_engine.core.scheduler_output import (
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    SchedulerOutput,
)
from rollout_engine.protocol import SamplingParams
from rollout_engine.worker.persistent_batch import PersistentBatch, StepRequest

_SCHEDULER_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}
_SCHEDULER_DEFAULTS = {"max_num_batched_tokens": 64, "max_num_seqs": 16, "max_model_len": 256}
_CACHE_DEFAULTS = {"block_size": 4, "num_blocks": 128, "enable_prefix_caching": True}

# Prompt tokens come from a fresh range per request, so prefix caching only sees the
# sharing a test asks for; generated tokens live in a range of their own.
_PROMPT_TOKEN_BASE = 100_000
_next_prompt_token = itertools.count(_PROMPT_TOKEN_BASE)
GENERATED_TOKEN_BASE = 10_000_000

TokenFn = Callable[[str, int], int]


def make_scheduler(
    *,
    num_speculative_tokens: int = 0,
    eos_token_ids: Sequence[int] | None = None,
    clock: Callable[[], float] = time.monotonic,
    **overrides: object,
) -> Scheduler:
    """A scheduler with small test defaults; any SchedulerConfig/CacheConfig field overrides.

    With `eos_token_ids` the limits go through `RuntimeLimits`, as the engine passes them.
    """
    scheduler_kwargs = dict(_SCHEDULER_DEFAULTS)
    cache_kwargs = dict(_CACHE_DEFAULTS)
    for key, value in overrides.items():
        if key in _SCHEDULER_FIELDS:
            scheduler_kwargs[key] = value
        elif key in _CACHE_FIELDS:
            cache_kwargs[key] = value
        else:
            raise TypeError(f"unknown scheduler option {key!r}")
    scheduler_config = SchedulerConfig(**scheduler_kwargs)
    cache_config = CacheConfig(**cache_kwargs)
    speculative_config = SpeculativeConfig(num_speculative_tokens=num_speculative_tokens)
    limits = None
    if eos_token_ids is not None:
        limits = RuntimeLimits(
            num_blocks=cache_config.num_blocks,
            max_model_len=scheduler_config.max_model_len,
            vocab_size=GENERATED_TOKEN_BASE * 2,
            eos_token_ids=tuple(eos_token_ids),
        )
    return Scheduler(scheduler_config, cache_config, speculative_config, limits, clock=clock)


def fresh_token_ids(num_tokens: int) -> list[int]:
    """Token ids never handed out before in this process."""
    return [next(_next_prompt_token) for _ in range(num_tokens)]


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int] | None = None,
    *,
    num_prompt_tokens: int = 8,
    max_tokens: int = 16,
    group_id: str | None = None,
    sample_index: int = 0,
    **sampling_kwargs: object,
) -> Request:
    """One request; without explicit prompt tokens it gets fresh, unshared ones."""
    if prompt_token_ids is None:
        prompt_token_ids = fresh_token_ids(num_prompt_tokens)
    params = SamplingParams(max_tokens=max_tokens, **sampling_kwargs)
    return Request(
        request_id, list(prompt_token_ids), params, group_id=group_id, sample_index=sample_index
    )


def make_requests(
    num_requests: int,
    num_prompt_tokens: int = 8,
    *,
    prefix_token_ids: Sequence[int] = (),
    id_prefix: str = "req",
    **kwargs: object,
) -> list[Request]:
    """`num_requests` requests, each `prefix_token_ids` + fresh tokens up to the length."""
    num_fresh = num_prompt_tokens - len(prefix_token_ids)
    assert num_fresh >= 0, f"prefix of {len(prefix_token_ids)} exceeds {num_prompt_tokens}"
    return [
        make_request(
            f"{id_prefix}-{i}", list(prefix_token_ids) + fresh_token_ids(num_fresh), **kwargs
        )
        for i in range(num_requests)
    ]


def make_group(
    group_id: str, n: int, prompt_token_ids: Sequence[int], **kwargs: object
) -> list[Request]:
    """The `n` sampled requests of one prompt (a GRPO group), as the engine builds them."""
    return [
        make_request(
            f"{group_id}/{j}", prompt_token_ids, group_id=group_id, sample_index=j, **kwargs
        )
        for j in range(n)
    ]


def token_for(request_id: str, position: int) -> int:
    """The stand-in model's token at `position` of a request: a fixed function of both."""
    return GENERATED_TOKEN_BASE + zlib.crc32(f"{request_id}@{position}".encode()) % 1_000_000


def expected_outputs(request_id: str, num_prompt_tokens: int, num_outputs: int) -> list[int]:
    """What the stand-in model generates after a prompt of `num_prompt_tokens`."""
    return [token_for(request_id, num_prompt_tokens + i) for i in range(num_outputs)]


def logprob_for(position: int) -> float:
    return -0.125 * (position % 8)


class FakeModelRunner:
    """Plays the model runner for the ledger: samples known tokens and simulates the KV cache.

    The "model" emits `token_fn(request_id, position)` at every position. Drafts are
    verified greedily against it (accept while equal), unless `num_accepted` fixes how
    many drafts to accept (an int for all requests, or a mapping by request id).

    The KV cache is simulated: the value written at a position is a hash of the whole
    token prefix up to it, as real KV depends on every earlier token. After a step's
    writes, every position a request attends to must hold its own prefix's value, so a
    wrong cache hit, a block reused while referenced, or stale draft KV that is read fails.

    Under async scheduling a step may run before the previous one's outputs are committed;
    a placeholder input is resolved from what the previous step sampled for the request,
    as the real runner does on the device.

    It sees the scheduler only through its deltas, as the real runner does: a
    `PersistentBatch` rebuilds each step's requests, and every step checks that what the
    batch holds is what the scheduler believes it sent (`check_worker_state`).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        token_fn: TokenFn = token_for,
        num_accepted: int | Mapping[str, int] | None = None,
        check_kv: bool = True,
    ) -> None:
        self.token_fn = token_fn
        self.num_accepted = num_accepted
        self.check_kv = check_kv
        self.scheduler = scheduler
        self.batch = PersistentBatch()
        self.block_size = scheduler.block_size
        num_blocks = scheduler.kv_cache_manager.num_blocks
        self.kv: list[list[int | None]] = [[None] * self.block_size for _ in range(num_blocks)]
        self.num_steps = 0
        self.num_drafts_scheduled = 0
        self.num_drafts_accepted = 0
        self._previous_step_tokens: dict[str, int] = {}
        self.last_step: dict[str, StepRequest] = {}
        """The requests of the last step run, by id, as the worker saw them."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        step = self.batch.update(scheduler_output)
        check_worker_state(self.scheduler, self.batch)
        self.last_step = {s.request_id: s for s in step}
        sequences = {s.request_id: self._check_inputs(s) for s in step}
        if self.check_kv:
            self._write_kv(step, sequences)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[float]] = {}
        for scheduled in step:
            if not scheduled.needs_sample:
                continue
            tokens = self._sample(scheduled)
            first = _first_sampled_position(scheduled)
            sampled[scheduled.request_id] = tokens
            logprobs[scheduled.request_id] = [logprob_for(first + i) for i in range(len(tokens))]
        self._previous_step_tokens = {rid: tokens[-1] for rid, tokens in sampled.items()}
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def drop_requests(self, scheduler_output: SchedulerOutput) -> None:
        """An empty step (not run): the worker still forgets what it finished or preempted."""
        self.batch.forget_dropped(scheduler_output)

    def _check_inputs(self, scheduled: StepRequest) -> list[int]:
        """The request's tokens (committed + drafts); checks what the runner was given."""
        committed = list(scheduled.token_ids)
        num_spec = scheduled.num_spec_tokens
        drafts = scheduled.input_token_ids[len(scheduled.input_token_ids) - num_spec :]
        sequence = committed + drafts
        start = scheduled.start_position
        end = start + len(scheduled.input_token_ids)
        inputs = list(scheduled.input_token_ids)
        if scheduled.input_from_previous_step:
            rid = scheduled.request_id
            assert inputs == [PLACEHOLDER_TOKEN_ID] and num_spec == 0, scheduled
            assert rid in self._previous_step_tokens, f"{rid}: the previous step sampled nothing"
            assert start >= scheduled.num_prompt_tokens, scheduled
            # The committed list may not have the in-flight token yet: it is at `start`.
            sequence = committed[:start] + [self._previous_step_tokens[rid]]
            inputs = sequence[start:end]
            expected = self.token_fn(rid, start)
            assert inputs == [expected], f"{rid}: placeholder resolved to {inputs}, not {expected}"
        assert scheduled.input_token_ids, f"{scheduled.request_id}: empty input"
        assert inputs == sequence[start:end], (
            f"{scheduled.request_id}: input {scheduled.input_token_ids} != tokens "
            f"{sequence[start:end]} at [{start}, {end})"
        )
        if num_spec:
            assert end - num_spec == len(committed), f"{scheduled.request_id}: drafts misplaced"
        assert scheduled.needs_sample == (end >= len(sequence) - num_spec), scheduled.request_id
        assert len(scheduled.block_ids) * self.block_size >= end, (
            f"{scheduled.request_id}: {len(scheduled.block_ids)} blocks for {end} positions"
        )
        assert len(set(scheduled.block_ids)) == len(scheduled.block_ids), scheduled.block_ids
        return sequence

    def _write_kv(
        self, scheduled_requests: list[StepRequest], sequences: dict[str, list[int]]
    ) -> None:
        bs = self.block_size
        writes: dict[tuple[int, int], int] = {}
        chains: dict[str, list[int]] = {}
        for scheduled in scheduled_requests:
            chain = prefix_hashes(sequences[scheduled.request_id])
            chains[scheduled.request_id] = chain
            end = scheduled.start_position + len(scheduled.input_token_ids)
            for pos in range(scheduled.start_position, end):
                slot = (scheduled.block_ids[pos // bs], pos % bs)
                previous = writes.setdefault(slot, chain[pos])
                assert previous == chain[pos], (
                    f"two requests write different KV to block {slot[0]} slot {slot[1]} "
                    f"in one step ({scheduled.request_id} at position {pos})"
                )
        for (block_id, offset), value in writes.items():
            self.kv[block_id][offset] = value
        for scheduled in scheduled_requests:
            chain = chains[scheduled.request_id]
            end = scheduled.start_position + len(scheduled.input_token_ids)
            for pos in range(end):
                block_id = scheduled.block_ids[pos // bs]
                assert self.kv[block_id][pos % bs] == chain[pos], (
                    f"{scheduled.request_id} reads wrong KV at position {pos} "
                    f"(block {block_id}, start {scheduled.start_position})"
                )

    def _sample(self, scheduled: StepRequest) -> list[int]:
        rid = scheduled.request_id
        num_committed = _first_sampled_position(scheduled)
        num_spec = scheduled.num_spec_tokens
        drafts = scheduled.input_token_ids[len(scheduled.input_token_ids) - num_spec :]
        if self.num_accepted is None:
            num_ok = 0
            while num_ok < num_spec and drafts[num_ok] == self.token_fn(
                rid, num_committed + num_ok
            ):
                num_ok += 1
        elif isinstance(self.num_accepted, int):
            num_ok = min(self.num_accepted, num_spec)
        else:
            num_ok = min(self.num_accepted.get(rid, 0), num_spec)
        self.num_drafts_scheduled += num_spec
        self.num_drafts_accepted += num_ok
        return drafts[:num_ok] + [self.token_fn(rid, num_committed + num_ok)]


def _first_sampled_position(scheduled: StepRequest) -> int:
    """Position of the first token a sampling step produces (after its last committed input)."""
    return scheduled.start_position + len(scheduled.input_token_ids) - scheduled.num_spec_tokens


def check_worker_state(scheduler: Scheduler, batch: PersistentBatch) -> None:
    """Right after a step's deltas were applied: the worker holds exactly the requests the
    scheduler believes it sent, with the tokens and blocks it sent them."""
    kv = scheduler.kv_cache_manager
    held = {rid: r for rid, r in scheduler.requests.items() if r.num_tokens_on_worker}
    # Requests ended since the step was scheduled are dropped with the next step.
    ended_since = set(scheduler._finished_request_ids)
    assert set(held) <= set(batch.requests) <= set(held) | ended_since, (
        f"the worker holds {sorted(batch.requests)}, the scheduler sent {sorted(held)}"
    )
    for request_id, request in held.items():
        state = batch.requests[request_id]
        assert state.token_ids == request.all_token_ids[: request.num_tokens_on_worker], request
        blocks = kv.get_block_ids(request_id)[: request.num_blocks_on_worker]
        assert state.block_ids == blocks, f"{request}: worker {state.block_ids} != {blocks}"
        assert state.num_prompt_tokens == request.num_prompt_tokens, request
        assert state.sampling_params is request.sampling_params, request
        assert list(batch.table[state.row, : len(blocks)]) == blocks, request


def prefix_hashes(token_ids: Sequence[int]) -> list[int]:
    """hashes[p] stands for the KV at position p: it depends on tokens[0..p]."""
    hashes, h = [], 0
    for token_id in token_ids:
        h = hash((h, token_id))
        hashes.append(h)
    return hashes


def run_step(
    scheduler: Scheduler, runner: FakeModelRunner
) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step: schedule, run, commit."""
    scheduler_output = scheduler.schedule()
    runner_output = runner.execute(scheduler_output)
    return scheduler_output, scheduler.update_from_output(scheduler_output, runner_output)


def iterate_steps(
    scheduler: Scheduler, runner: FakeModelRunner, max_steps: int = 10_000
) -> Iterator[tuple[SchedulerOutput, list[Request]]]:
    """Step until no request is left, checking the ledger; fails instead of looping forever."""
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        yield run_step(scheduler, runner)
        check_ledger_invariants(scheduler)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def run_until_done(scheduler: Scheduler, runner: FakeModelRunner, max_steps: int = 10_000) -> int:
    """Step until no request is left; returns the number of steps."""
    return sum(1 for _ in iterate_steps(scheduler, runner, max_steps))


def iterate_async_steps(
    scheduler: Scheduler,
    runner: FakeModelRunner,
    max_steps: int = 10_000,
    before_landing: Callable[[SchedulerOutput], None] | None = None,
) -> Iterator[tuple[SchedulerOutput, list[Request]]]:
    """Async scheduling as the engine drives it: step N+1 is scheduled (and, in device order,
    run) before step N's outputs are committed. Yields each step as it lands; checks the
    ledger between steps. `before_landing(step)` runs just before a step lands (aborts...)."""
    in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    for _ in range(max_steps):
        if in_flight is None and not scheduler.has_unfinished_requests():
            return
        scheduled = scheduler.schedule() if scheduler.has_unfinished_requests() else None
        if scheduled is not None and scheduled.is_empty:
            assert in_flight is not None, "nothing scheduled and nothing in flight: a stall"
            scheduler.update_from_output(scheduled, ModelRunnerOutput(sampled_token_ids={}))
            runner.drop_requests(scheduled)
            scheduled = None
        launched = None if scheduled is None else (scheduled, runner.execute(scheduled))
        if in_flight is not None:
            if before_landing is not None:
                before_landing(in_flight[0])
            yield in_flight[0], scheduler.update_from_output(*in_flight)
        in_flight = launched
        check_ledger_invariants(scheduler, num_in_flight=int(in_flight is not None))
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def run_async_until_done(
    scheduler: Scheduler, runner: FakeModelRunner, max_steps: int = 10_000
) -> int:
    """`run_until_done` under async scheduling; returns the number of steps."""
    return sum(1 for _ in iterate_async_steps(scheduler, runner, max_steps))


def check_ledger_invariants(scheduler: Scheduler, num_in_flight: int = 0) -> None:
    """Between steps: queues, ledger and block ref counts agree with each other.

    `num_in_flight`: steps scheduled whose outputs have not landed (async scheduling).
    Once every step has landed, the ledger is what the synchronous loop would have.
    """
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    running_ids = {r.request_id for r in scheduler.running}
    waiting_ids = {r.request_id for r in scheduler.waiting}
    assert len(running_ids) == len(scheduler.running), f"duplicate running: {scheduler.running}"
    assert len(waiting_ids) == len(scheduler.waiting), f"duplicate waiting: {scheduler.waiting}"
    assert not running_ids & waiting_ids, "a request both running and waiting"
    loading_ids = {r.request_id for r in scheduler.kv_connector.loading_requests}
    assert not loading_ids & (running_ids | waiting_ids), "a request loading KV is queued too"
    assert running_ids | waiting_ids | loading_ids == set(scheduler.requests)
    assert len(running_ids) <= scheduler.config.max_num_seqs
    ref_counts: Counter[int] = Counter()
    for request in scheduler.requests.values():
        block_ids = kv.get_block_ids(request.request_id)
        assert len(set(block_ids)) == len(block_ids), f"{request}: repeated block {block_ids}"
        assert 0 <= request.num_output_placeholders <= num_in_flight, request
        assert request.num_steps_in_flight <= num_in_flight, request
        assert (
            0 <= request.num_computed_tokens <= request.num_tokens + request.num_output_placeholders
        ), request
        assert len(block_ids) * scheduler.block_size >= request.num_computed_tokens, request
        assert request.num_tokens <= scheduler.max_model_len, request
        if request.status is RequestStatus.RUNNING:
            assert request.request_id in running_ids and block_ids, request
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            assert request.request_id in loading_ids and request.wants_remote_kv, request
            num_loaded = request.num_computed_tokens + request.num_external_computed_tokens
            assert len(block_ids) * scheduler.block_size >= num_loaded, request
            assert num_loaded < request.num_prompt_tokens, request
            # Its blocks past the local hits are in nobody else's reach until the load lands.
            first_loaded_block = request.num_computed_tokens // scheduler.block_size
            for block_id in block_ids[first_loaded_block:]:
                assert pool.blocks[block_id].block_hash is None, f"{request}: loading block cached"
        elif request.num_external_computed_tokens and request.num_computed_tokens:
            # Its KV was loaded from a remote engine: it waits holding those blocks.
            assert request.request_id in waiting_ids, request
            assert request.num_computed_tokens < request.num_prompt_tokens, request
            assert len(block_ids) * scheduler.block_size >= request.num_computed_tokens, request
        else:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
            assert request.request_id in waiting_ids, request
            assert request.num_computed_tokens == 0 and not block_ids, request
            assert request.num_output_placeholders == 0, request
        ref_counts.update(block_ids)
    for request in scheduler.kv_connector.take_to_save():
        assert request.is_finished and request.saves_kv, request
        ref_counts.update(kv.get_block_ids(request.request_id))
    for request in scheduler._finished_in_flight.values():
        assert num_in_flight and request.is_finished and request.num_steps_in_flight, request
        ref_counts.update(kv.get_block_ids(request.request_id))
    ref_counts.update(kv.holds.block_refs())  # finished turns kept for their next turn
    for block in pool.blocks:
        assert block.ref_count == ref_counts[block.block_id], (
            f"block {block.block_id}: ref_count {block.ref_count}, "
            f"{ref_counts[block.block_id]} block tables hold it"
        )
        is_free = block.block_id in pool._free
        assert is_free == (block.ref_count == 0), f"block {block.block_id} free={is_free}"
    assert pool.num_free_blocks == pool.num_blocks - len(ref_counts)
    for block_hash, block in pool._cached.items():
        assert block.block_hash == block_hash, f"block {block.block_id} indexed under a stale hash"
        assert len(block.token_ids) == scheduler.block_size, block
    assert sum(b.block_hash is not None for b in pool.blocks) == pool.num_cached_blocks
