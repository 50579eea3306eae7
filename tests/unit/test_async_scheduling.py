"""The token ledger under async scheduling: step N+1 is scheduled before step N's tokens land.

The stand-in runner resolves each placeholder from what the previous step sampled, and
checks every input token and every KV read; the ledger is checked between steps.
"""

from __future__ import annotations

import random

import pytest

from rollout_engine.core.request import RequestStatus
from rollout_engine.core.scheduler_output import (
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    SchedulerOutput,
)
from tests.unit.factories import (
    FakeModelRunner,
    check_ledger_invariants,
    expected_outputs,
    fresh_token_ids,
    iterate_async_steps,
    make_group,
    make_request,
    make_scheduler,
    run_async_until_done,
    run_step,
    run_until_done,
    token_for,
)
from tests.unit.test_scheduler_stress import (
    EOS,
    StressConfig,
    StressRun,
    assert_run_was_eventful,
    stress_token,
)


def test_worked_example_under_async_scheduling() -> None:
    """DESIGN's worked example (budget 6; P decodes, Q prefills, R waits), one step ahead."""
    scheduler = make_scheduler(max_num_batched_tokens=6, async_scheduling=True)
    runner = FakeModelRunner(scheduler)
    p = make_request("P", num_prompt_tokens=18, max_tokens=100)
    q = make_request("Q", num_prompt_tokens=9, max_tokens=100)
    r = make_request("R", num_prompt_tokens=7, max_tokens=100)
    scheduler.add_request(p)
    for _ in range(3):
        run_step(scheduler, runner)
    scheduler.add_request(q)
    run_step(scheduler, runner)
    assert (p.num_tokens, p.num_computed_tokens, q.num_computed_tokens) == (20, 19, 5)
    scheduler.add_request(r)

    step_n = scheduler.schedule()
    assert step_n.num_scheduled_tokens == {"P": 1, "Q": 4, "R": 1}
    assert [p.num_computed_tokens, q.num_computed_tokens, r.num_computed_tokens] == [20, 9, 1]
    assert (p.num_output_placeholders, q.num_output_placeholders) == (1, 1)
    output_n = runner.execute(step_n)

    # Step N+1 is scheduled before step N's tokens are known: P and Q get one position
    # each, whose input is the token step N samples; R's prompt goes on.
    step_n1 = scheduler.schedule()
    assert step_n1.num_scheduled_tokens == {"P": 1, "Q": 1, "R": 4}
    output_n1 = runner.execute(step_n1)
    by_id = runner.last_step  # the step's requests as the worker saw them
    for request_id, position in (("P", 20), ("Q", 9)):
        assert by_id[request_id].input_from_previous_step
        assert by_id[request_id].input_token_ids == [PLACEHOLDER_TOKEN_ID]
        assert by_id[request_id].start_position == position
    assert not by_id["R"].input_from_previous_step and not by_id["R"].needs_sample
    assert [p.num_computed_tokens, q.num_computed_tokens, r.num_computed_tokens] == [21, 10, 5]
    assert (p.num_tokens, p.num_output_placeholders) == (20, 2)
    check_ledger_invariants(scheduler, num_in_flight=2)

    scheduler.update_from_output(step_n, output_n)  # step N lands
    assert (p.num_tokens, q.num_tokens, r.num_tokens) == (21, 10, 7)
    assert (p.num_output_placeholders, q.num_output_placeholders) == (1, 1)
    check_ledger_invariants(scheduler, num_in_flight=1)
    scheduler.update_from_output(step_n1, output_n1)  # step N+1 lands
    # Every output has landed: the ledger is what the synchronous loop leaves.
    for request in (p, q):
        assert request.num_tokens - request.num_computed_tokens == 1
        assert request.num_output_placeholders == 0
    assert p.output_token_ids == expected_outputs("P", 18, 4)
    assert q.output_token_ids == expected_outputs("Q", 9, 2)
    check_ledger_invariants(scheduler)


def run_both_ways(make_requests, **scheduler_options) -> list[tuple[list[int], str, list]]:
    """Outputs, finish reasons and logprobs of the same workload, sync then async."""
    results = []
    for async_scheduling in (False, True):
        scheduler = make_scheduler(async_scheduling=async_scheduling, **scheduler_options)
        runner = FakeModelRunner(scheduler, token_fn=stress_token)
        requests = make_requests()
        for request in requests:
            scheduler.add_request(request)
        if async_scheduling:
            run_async_until_done(scheduler, runner)
        else:
            run_until_done(scheduler, runner)
        assert scheduler.num_free_blocks == scheduler.num_blocks, "leaked blocks"
        results.append(
            [(r.output_token_ids, r.finish_reason, r.output_logprobs) for r in requests]
        )
    return results


@pytest.mark.parametrize("num_blocks", [128, 12])
def test_same_outputs_as_the_synchronous_loop(num_blocks: int) -> None:
    """Groups, EOS, stop tokens, max_tokens and model-length caps; a tiny pool preempts."""
    rng = random.Random(num_blocks)
    prompts = [fresh_token_ids(rng.randint(3, 20)) for _ in range(6)]
    max_tokens = [rng.randint(1, 30) for _ in prompts]

    def make_requests():
        requests = []
        for i, prompt in enumerate(prompts):
            requests += make_group(
                f"g{i}", 1 + i % 3, prompt, max_tokens=max_tokens[i],
                stop_token_ids=[stress_token(f"g{i}/0", len(prompt) + 3)] if i == 2 else [],
            )
        return requests

    sync, async_ = run_both_ways(
        make_requests, num_blocks=num_blocks, max_model_len=40, eos_token_ids=[EOS]
    )
    assert async_ == sync


def test_a_request_ending_in_step_n_drops_step_n1_and_frees_its_blocks_when_it_lands() -> None:
    scheduler = make_scheduler(async_scheduling=True, eos_token_ids=[EOS])
    prompt = fresh_token_ids(6)
    # The stand-in model samples EOS as the second output token of "a".
    runner = FakeModelRunner(
        scheduler, token_fn=lambda rid, pos: EOS if (rid, pos) == ("a", 7) else token_for(rid, pos)
    )
    a = make_request("a", prompt, max_tokens=50)
    scheduler.add_request(a)
    steps = [scheduler.schedule()]  # prefill: samples position 6
    outputs = [runner.execute(steps[0])]
    steps.append(scheduler.schedule())  # position 7 from a placeholder: samples EOS
    outputs.append(runner.execute(steps[1]))
    scheduler.update_from_output(steps[0], outputs[0])
    steps.append(scheduler.schedule())  # position 8: scheduled before EOS is known
    assert steps[2].num_scheduled_tokens == {"a": 1} and a.num_output_placeholders == 2
    outputs.append(runner.execute(steps[2]))
    num_blocks_held = len(scheduler.kv_cache_manager.get_block_ids("a"))

    scheduler.update_from_output(steps[1], outputs[1])  # EOS lands
    assert a.is_finished and a.finish_reason == "stop"
    assert a.output_token_ids == [token_for("a", 6), EOS]
    # Step N+1 still writes a's last block: nothing is freed until it lands.
    assert scheduler.num_free_blocks == scheduler.num_blocks - num_blocks_held
    assert scheduler.num_finished_in_flight == 1
    check_ledger_invariants(scheduler, num_in_flight=1)

    updated = scheduler.update_from_output(steps[2], outputs[2])
    assert updated == [] and a.output_token_ids == [token_for("a", 6), EOS], "no extra token"
    assert scheduler.num_free_blocks == scheduler.num_blocks
    assert scheduler.num_finished_in_flight == 0
    assert steps[3:] == [] and not scheduler.has_unfinished_requests()


def test_no_work_is_scheduled_past_max_tokens() -> None:
    """A request whose in-flight token is its last gets no step N+1 (it would be wasted)."""
    scheduler = make_scheduler(async_scheduling=True)
    runner = FakeModelRunner(scheduler)
    a = make_request("a", num_prompt_tokens=5, max_tokens=2)
    scheduler.add_request(a)
    scheduled = [output.num_scheduled_tokens for output, _ in iterate_async_steps(scheduler, runner)]
    assert scheduled == [{"a": 5}, {"a": 1}]
    assert a.output_token_ids == expected_outputs("a", 5, 2) and a.finish_reason == "length"


def test_preemption_with_an_output_in_flight_drops_it_as_stale() -> None:
    # 4 blocks of 4: both prompts fit (2 blocks each), but neither can grow past 8 positions
    # while the other holds its blocks.
    scheduler = make_scheduler(async_scheduling=True, num_blocks=4, max_num_batched_tokens=16)
    runner = FakeModelRunner(scheduler)
    old, new = (make_request(rid, num_prompt_tokens=5, max_tokens=6) for rid in ("old", "new"))
    scheduler.add_request(old)
    scheduler.add_request(new)
    stale = []

    def note_stale_outputs(step) -> None:
        for scheduled in step.scheduled_requests:
            request = old if scheduled.request_id == "old" else new
            if scheduled.needs_sample and request.num_preemptions != scheduled.num_preemptions:
                assert request.status is RequestStatus.PREEMPTED
                assert request.num_output_placeholders == 0
                stale.append((request, request.num_output_tokens))

    num_stale = 0
    for output, updated in iterate_async_steps(scheduler, runner, before_landing=note_stale_outputs):
        assert output.preempted_request_ids in ([], ["new"])
        for request, num_outputs in stale:  # the outputs of this landing that were stale
            assert request not in updated and request.num_output_tokens == num_outputs
        num_stale += len(stale)
        stale.clear()
    assert num_stale, "no output was in flight when its request was preempted"
    assert new.num_preemptions >= 1
    for request in (old, new):
        assert request.output_token_ids == expected_outputs(request.request_id, 5, 6)
    assert scheduler.num_free_blocks == scheduler.num_blocks


def test_an_abort_with_work_in_flight_frees_everything_once_it_lands() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    runner = FakeModelRunner(scheduler)
    group = make_group("g", 3, fresh_token_ids(9), max_tokens=20)
    for request in group:
        scheduler.add_request(request)
    aborted_at = []

    def abort_in_flight(step) -> None:
        if len(aborted_at) == 0 and group[0].num_output_tokens == 3:
            scheduler.finish_requests([r.request_id for r in group])
            aborted_at.append(scheduler.num_free_blocks)
            assert scheduler.num_finished_in_flight == 3  # two steps still write their blocks

    landed = list(iterate_async_steps(scheduler, runner, before_landing=abort_in_flight))
    assert aborted_at and aborted_at[0] < scheduler.num_blocks
    assert all(r.finish_reason == "abort" and r.num_output_tokens == 3 for r in group)
    assert all(updated == [] for _, updated in landed[-2:]), "tokens reached aborted requests"
    assert scheduler.num_free_blocks == scheduler.num_blocks
    assert scheduler.num_finished_in_flight == 0


def test_a_discarded_step_frees_the_blocks_of_its_ended_requests() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    runner = FakeModelRunner(scheduler)
    a = make_request("a", num_prompt_tokens=9, max_tokens=20)
    scheduler.add_request(a)
    run_step(scheduler, runner)
    step_n = scheduler.schedule()
    step_n1 = scheduler.schedule()
    # Step N's compute failed: the engine ends its requests, then discards both steps.
    scheduler.finish_requests(["a"])
    assert scheduler.num_free_blocks < scheduler.num_blocks
    scheduler.discard_step(step_n)
    scheduler.discard_step(step_n1)
    assert scheduler.num_free_blocks == scheduler.num_blocks
    assert scheduler.num_finished_in_flight == 0
    check_ledger_invariants(scheduler)


def test_siblings_wait_for_a_prompt_in_flight_and_then_hit_its_blocks() -> None:
    """A group split across steps still computes its prompt once under async scheduling."""
    scheduler = make_scheduler(async_scheduling=True, max_num_batched_tokens=24)
    runner = FakeModelRunner(scheduler)
    group = make_group("g", 3, fresh_token_ids(20), max_tokens=4)
    for request in group:
        scheduler.add_request(request)
    steps = [output for output, _ in iterate_async_steps(scheduler, runner)]
    num_prompt_positions = sum(
        max(0, min(s.start_position + s.num_tokens, 20) - s.start_position)
        for output in steps for s in output.scheduled_requests
    )
    # g/0 prefills all 20 tokens; g/1 shares its 4 full blocks in the same step; g/2 comes
    # once the budget allows, waits for the prompt in flight to land, then hits the cache.
    assert num_prompt_positions == 20 + 4 + 4
    for request in group:
        assert request.output_token_ids == expected_outputs(request.request_id, 20, 4)


class AsyncStressRun(StressRun):
    """The random workload of the stress test, driven one step ahead, with aborts landing
    between a step's scheduling and its outputs."""

    async_scheduling = True

    def __init__(self, seed: int, config: StressConfig) -> None:
        super().__init__(seed, config)
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None

    def _has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.in_flight is not None

    def _step(self) -> None:
        if self.rng.random() < self.config.abort_prob:
            self._abort_random()
        launched = None
        if self.scheduler.has_unfinished_requests():
            output = self.scheduler.schedule()
            self.stats.num_preemptions += len(output.preempted_request_ids)
            if not output.is_empty:
                launched = (output, self.runner.execute(output))
            else:
                assert self.in_flight is not None, "stalled"
                self.scheduler.update_from_output(output, ModelRunnerOutput({}))
                self.runner.drop_requests(output)  # as the engine tells the worker
        if self.rng.random() < self.config.abort_prob / 2:
            self._abort_random()  # arrives while steps are in flight
        if self.in_flight is not None:
            self.scheduler.update_from_output(*self.in_flight)
        self.in_flight = launched
        check_ledger_invariants(self.scheduler, num_in_flight=int(launched is not None))
        self.stats.num_steps += 1


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "config",
    [
        StressConfig(num_groups=200, num_speculative_tokens=0, block_size=8, num_blocks=24),
        StressConfig(num_groups=150, num_speculative_tokens=0, max_model_len=64, num_blocks=17),
    ],
    ids=["small-pool", "minimal-pool"],
)
def test_random_workload_under_async_scheduling(config: StressConfig, seed: int) -> None:
    run = AsyncStressRun(seed, config)
    stats = run.run()
    stats.num_hit_tokens = run.scheduler.num_prefix_hit_tokens
    assert_run_was_eventful(stats, run.runner, config)
