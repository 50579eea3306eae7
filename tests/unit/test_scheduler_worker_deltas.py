"""The scheduler sends the worker deltas: a request's data once, then only what changed.

`FakeModelRunner` rebuilds every step from the deltas with the worker's own
`PersistentBatch` and checks, after every step, that what the batch holds is what the
scheduler sent (`check_worker_state`); these tests walk a request through its whole life and
check what crossed the boundary at each step.
"""

from __future__ import annotations

import pickle

import pytest

from rollout_engine.core.request import RequestStatus
from rollout_engine.core.scheduler_output import SchedulerOutput
from tests.unit.factories import (
    FakeModelRunner,
    check_ledger_invariants,
    expected_outputs,
    iterate_async_steps,
    make_request,
    make_scheduler,
    run_step,
)


def test_a_request_crosses_once_when_new_and_once_when_resumed() -> None:
    """new -> cached -> preempted -> resumed -> finished, with the worker's state equal to
    the scheduler's after every step, and the prompt sent only when new or resumed."""
    scheduler = make_scheduler(num_blocks=15)
    runner = FakeModelRunner(scheduler)
    a, b, c = (make_request(rid, num_prompt_tokens=16, max_tokens=8) for rid in "abc")
    for request in (a, b, c):
        scheduler.add_request(request)
    sent_whole: list[tuple[str, int, int]] = []  # (id, prompt tokens, output tokens) sent
    phases: list[str] = []  # c's life, one entry per step

    def step() -> SchedulerOutput:
        output, _ = run_step(scheduler, runner)  # the runner checks the worker's state
        check_ledger_invariants(scheduler)
        for new in output.new_requests:
            sent_whole.append(
                (new.request_id, len(new.prompt_token_ids), len(new.output_token_ids))
            )
        for scheduled in output.scheduled_requests:
            if scheduled.request_id not in {n.request_id for n in output.new_requests}:
                # An already-held request gets what is new: the token sampled since.
                assert len(scheduled.new_token_ids) == 1, scheduled
                assert len(scheduled.new_block_ids) <= 1, scheduled
        if "c" in output.preempted_request_ids:
            phases.append("preempted")
            assert "c" not in runner.batch.requests
        elif any(n.request_id == "c" for n in output.new_requests):
            phases.append("resumed" if "new" in phases else "new")
        elif "c" in output.num_scheduled_tokens:
            phases.append("cached")
        if "c" in output.finished_request_ids:
            phases.append("finished")
            assert "c" not in runner.batch.requests
        return output

    for _ in range(5):  # the prompts (4 blocks each), then one block more each: 0 free
        step()
    d = make_request("d", num_prompt_tokens=4, max_tokens=8)
    scheduler.add_request(d)
    step()  # a needs a 6th block: c, the newest, is preempted
    assert c.status is RequestStatus.PREEMPTED
    num_c_outputs = c.num_output_tokens
    while scheduler.has_unfinished_requests():
        step()
    step()  # the last finished ids reach the worker with the next step
    assert runner.batch.requests == {}

    collapsed = [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]]
    assert collapsed == ["new", "cached", "preempted", "resumed", "cached", "finished"]
    # Whole requests crossed exactly when new (each once) and when c resumed (with the
    # outputs it had: its KV is recomputed over them).
    assert sent_whole == [
        ("a", 16, 0), ("b", 16, 0), ("c", 16, 0), ("d", 4, 0), ("c", 16, num_c_outputs)
    ] or sent_whole == [
        ("a", 16, 0), ("b", 16, 0), ("c", 16, 0), ("c", 16, num_c_outputs), ("d", 4, 0)
    ]
    for request in (a, b, c, d):
        assert request.output_token_ids == expected_outputs(
            request.request_id, request.num_prompt_tokens, 8
        )


def test_under_async_scheduling_the_worker_lags_by_the_tokens_in_flight() -> None:
    """Step N+1 is scheduled before step N's token is known: its delta carries no new token
    (the input is a placeholder) and the next one carries it; the state stays equal."""
    scheduler = make_scheduler(async_scheduling=True, num_blocks=32)
    runner = FakeModelRunner(scheduler)
    requests = [make_request(f"r{i}", num_prompt_tokens=9, max_tokens=10) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    num_new_tokens_sent = 0
    for output, _ in iterate_async_steps(scheduler, runner):
        for scheduled in output.scheduled_requests:
            num_new_tokens_sent += len(scheduled.new_token_ids)
            if scheduled.input_from_previous_step:
                assert len(scheduled.new_token_ids) <= 1
    # No token crossed twice, and the worker lagged by at most the tokens of the steps in
    # flight when a request was last scheduled (its last outputs end it: they never cross).
    num_held = [r.num_tokens_on_worker - r.num_prompt_tokens for r in requests]
    assert num_new_tokens_sent == sum(num_held) and scheduler.num_preemptions == 0
    assert all(10 - 3 <= n < 10 for n in num_held), num_held
    for request in requests:
        assert request.output_token_ids == expected_outputs(request.request_id, 9, 10)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_steps_message_does_not_grow_with_what_was_generated(async_scheduling: bool) -> None:
    """The per-step message (pickled, as tensor parallelism sends it to every rank) and the
    block ids the worker copies are the same at decode step 8 as at decode step 800."""
    scheduler = make_scheduler(
        async_scheduling=async_scheduling, num_blocks=2048, block_size=16, max_model_len=4096
    )
    runner = FakeModelRunner(scheduler, check_kv=False)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", num_prompt_tokens=64, max_tokens=1000))
    sizes: dict[int, list[int]] = {8: [], 800: []}
    copies: dict[int, int] = {}
    steps = iterate_async_steps(scheduler, runner) if async_scheduling else _sync_steps(
        scheduler, runner
    )
    for index, (output, _) in enumerate(steps):
        for at, window in sizes.items():
            if at <= index < at + 32:
                window.append(len(pickle.dumps(output)))
                copies[at] = copies.get(at, 0) + sum(
                    len(s.new_block_ids) for s in output.scheduled_requests
                )
        if index >= 832:
            break
    assert max(sizes[800]) <= max(sizes[8]) + 16  # a few bytes for larger integers
    # 4 requests x 32 steps x 1 token: 4 x 2 new 16-token blocks in either window.
    assert copies[8] == copies[800] == 8


def _sync_steps(scheduler, runner):
    while scheduler.has_unfinished_requests():
        yield run_step(scheduler, runner)
