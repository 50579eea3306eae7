"""Ledger-level tests of the scheduler: aborts, preemption by recompute, prefix caching."""

from __future__ import annotations

import pytest

from rollout_engine.core.request import RequestStatus
from tests.unit.factories import (
    FakeModelRunner,
    check_ledger_invariants,
    expected_outputs,
    fresh_token_ids,
    iterate_steps,
    make_group,
    make_request,
    make_scheduler,
    run_step,
    run_until_done,
)

EOS = 2


# ---------------------------------------------------------------- abort
def test_abort_waiting_and_running_requests_frees_their_blocks() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeModelRunner(scheduler)
    running = make_request("running", num_prompt_tokens=9)
    waiting = make_request("waiting", num_prompt_tokens=9)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_step(scheduler, runner)
    assert running.status is RequestStatus.RUNNING and waiting.status is RequestStatus.WAITING
    assert scheduler.kv_cache_manager.num_free_blocks < scheduler.kv_cache_manager.num_blocks
    scheduler.finish_requests(["waiting", "running", "unknown"])
    for request in (running, waiting):
        assert request.status is RequestStatus.FINISHED and request.finish_reason == "abort"
    assert not scheduler.running and not scheduler.waiting
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
    check_ledger_invariants(scheduler)
    output = scheduler.schedule()
    assert set(output.finished_request_ids) == {"running", "waiting"} and output.is_empty
    assert scheduler.schedule().finished_request_ids == []


def test_abort_during_a_step_drops_that_requests_tokens() -> None:
    scheduler = make_scheduler()
    runner = FakeModelRunner(scheduler)
    a, b = make_request("a", max_tokens=5), make_request("b", max_tokens=5)
    scheduler.add_request(a)
    scheduler.add_request(b)
    output = scheduler.schedule()
    runner_output = runner.execute(output)
    scheduler.finish_requests(["a"])
    updated = scheduler.update_from_output(output, runner_output)
    assert updated == [b]
    assert a.output_token_ids == [] and a.finish_reason == "abort"
    check_ledger_invariants(scheduler)
    scheduler.finish_requests(["a"], "stop")  # already finished: ignored
    assert a.finish_reason == "abort"
    run_until_done(scheduler, runner)
    assert b.output_token_ids == expected_outputs("b", 8, 5)


def test_abort_of_one_sibling_keeps_the_shared_blocks() -> None:
    scheduler = make_scheduler()
    runner = FakeModelRunner(scheduler)
    group = make_group("g", 2, fresh_token_ids(13), max_tokens=6)
    for request in group:
        scheduler.add_request(request)
    run_step(scheduler, runner)
    shared = scheduler.kv_cache_manager.get_block_ids("g/0")[:3]
    assert scheduler.kv_cache_manager.get_block_ids("g/1")[:3] == shared
    scheduler.finish_requests(["g/0"])
    pool = scheduler.kv_cache_manager.block_pool
    assert [pool.blocks[i].ref_count for i in shared] == [1, 1, 1]
    check_ledger_invariants(scheduler)
    run_until_done(scheduler, runner)
    assert group[1].output_token_ids == expected_outputs("g/1", 13, 6)


# ---------------------------------------------------------------- preemption by recompute
@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_preemption_by_recompute_when_blocks_run_out(enable_prefix_caching: bool) -> None:
    scheduler = make_scheduler(num_blocks=15, enable_prefix_caching=enable_prefix_caching)
    runner = FakeModelRunner(scheduler)
    a, b, c = (make_request(rid, num_prompt_tokens=16, max_tokens=8) for rid in "abc")
    for request in (a, b, c):
        scheduler.add_request(request)
    for _ in range(5):  # 4 prompt blocks each, then one more block each; 0 free
        output, _ = run_step(scheduler, runner)
        assert not output.preempted_request_ids
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    assert (c.num_tokens, c.num_computed_tokens) == (21, 20)
    d = make_request("d", num_prompt_tokens=4, max_tokens=8)
    scheduler.add_request(d)
    outputs_before = list(c.output_token_ids)

    output, _ = run_step(scheduler, runner)  # a needs a 6th block: c, the newest, goes
    assert output.preempted_request_ids == ["c"]
    assert output.num_scheduled_tokens == {"a": 1, "b": 1}  # and d is not admitted
    assert c.status is RequestStatus.PREEMPTED and c.num_preemptions == 1
    assert c.num_computed_tokens == 0 and scheduler.kv_cache_manager.get_block_ids("c") == []
    assert c.output_token_ids == outputs_before
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]
    assert scheduler.kv_cache_manager.num_free_blocks == 3
    check_ledger_invariants(scheduler)

    for output, _ in iterate_steps(scheduler, runner, max_steps=20):
        if "c" in output.num_scheduled_tokens:
            break
    else:
        pytest.fail("the preempted request never came back")
    check_ledger_invariants(scheduler)
    scheduled = next(s for s in output.scheduled_requests if s.request_id == "c")
    # Prompt and the 5 outputs are recomputed; with caching, c's surviving blocks are hit.
    start = 12 if enable_prefix_caching else 0
    assert scheduled.start_position == start
    assert output.num_scheduled_tokens["c"] == 21 - start
    inputs = runner.last_step["c"].input_token_ids
    assert inputs == c.all_token_ids[start:21] and scheduled.needs_sample
    assert c.output_token_ids[:5] == outputs_before and c.num_output_tokens == 6
    run_until_done(scheduler, runner)
    for request in (a, b, c):
        assert request.output_token_ids == expected_outputs(request.request_id, 16, 8)
    assert d.output_token_ids == expected_outputs("d", 4, 8)
    assert scheduler.kv_cache_manager.num_free_blocks == 15


def test_the_newest_request_preempts_itself_when_older_ones_took_the_last_block() -> None:
    scheduler = make_scheduler(num_blocks=9, enable_prefix_caching=False)
    runner = FakeModelRunner(scheduler)
    a, b = (make_request(rid, num_prompt_tokens=16, max_tokens=4) for rid in "ab")
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_step(scheduler, runner)
    output, _ = run_step(scheduler, runner)
    assert output.preempted_request_ids == ["b"]
    assert output.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    check_ledger_invariants(scheduler)
    run_until_done(scheduler, runner)
    assert a.output_token_ids == expected_outputs("a", 16, 4)
    assert b.output_token_ids == expected_outputs("b", 16, 4)


# ---------------------------------------------------------------- prefix caching
def test_prefix_cache_hits_across_requests_with_a_shared_prefix() -> None:
    scheduler = make_scheduler()
    runner = FakeModelRunner(scheduler)
    prefix = fresh_token_ids(12)
    scheduler.add_request(make_request("a", prefix + fresh_token_ids(3), max_tokens=2))
    run_until_done(scheduler, runner)
    b = make_request("b", prefix + fresh_token_ids(5), max_tokens=2)
    scheduler.add_request(b)
    output, _ = run_step(scheduler, runner)
    assert output.scheduled_requests[0].start_position == 12
    assert output.num_scheduled_tokens == {"b": 5}
    run_until_done(scheduler, runner)
    assert b.output_token_ids == expected_outputs("b", 17, 2)


def test_an_identical_prompt_recomputes_its_last_block() -> None:
    scheduler = make_scheduler()
    runner = FakeModelRunner(scheduler)
    prompt = fresh_token_ids(8)
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    run_until_done(scheduler, runner)
    scheduler.add_request(make_request("b", prompt, max_tokens=1))
    output, _ = run_step(scheduler, runner)
    assert output.scheduled_requests[0].start_position == 4
    assert output.num_scheduled_tokens == {"b": 4}


def test_freed_cached_blocks_are_revived_and_evicted_tail_first() -> None:
    scheduler = make_scheduler(num_blocks=8)
    runner = FakeModelRunner(scheduler)
    prompt = fresh_token_ids(12)
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    run_until_done(scheduler, runner)
    scheduler.add_request(make_request("b", prompt, max_tokens=1))
    output, _ = run_step(scheduler, runner)
    (scheduled,) = output.scheduled_requests
    assert scheduled.start_position == 8
    a_blocks = runner.last_step["b"].block_ids[:2]  # revived from the free queue
    # A 28-token request takes 7 of the 8 blocks: the prompt's tail blocks go first.
    scheduler.add_request(make_request("x", num_prompt_tokens=28, max_tokens=1))
    run_until_done(scheduler, runner)
    c = make_request("c", prompt, max_tokens=1)
    scheduler.add_request(c)
    output, _ = run_step(scheduler, runner)
    (scheduled,) = output.scheduled_requests
    assert scheduled.start_position == 4
    assert runner.last_step["c"].block_ids[0] == a_blocks[0]


def test_reset_prefix_cache_forgets_cached_prompts() -> None:
    scheduler = make_scheduler()
    runner = FakeModelRunner(scheduler)
    prompt = fresh_token_ids(12)
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    run_until_done(scheduler, runner)
    scheduler.kv_cache_manager.reset_prefix_cache()
    scheduler.add_request(make_request("b", prompt, max_tokens=1))
    output, _ = run_step(scheduler, runner)
    assert output.scheduled_requests[0].start_position == 0
    scheduler.add_request(make_request("c", prompt, max_tokens=1))
    output, _ = run_step(scheduler, runner)
    assert output.scheduled_requests[0].start_position == 8


def test_draft_positions_are_never_served_from_cache() -> None:
    scheduler = make_scheduler(num_speculative_tokens=2)
    runner = FakeModelRunner(scheduler, num_accepted=0)
    a = make_request("a", num_prompt_tokens=6, max_tokens=20)
    scheduler.add_request(a)
    run_step(scheduler, runner)
    draft = 6001
    a.spec_token_ids = [draft, 6002]  # position 7 gets the draft's KV, then it is rejected
    run_step(scheduler, runner)
    assert (a.num_tokens, a.num_computed_tokens) == (8, 7)
    with_draft = make_request("f1", a.prompt_token_ids + [a.output_token_ids[0], draft, 1])
    scheduler.add_request(with_draft)
    output, _ = run_step(scheduler, runner)
    assert next(s for s in output.scheduled_requests if s.request_id == "f1").start_position == 4
    committed = make_request("f2", a.all_token_ids[:8] + [1])
    scheduler.add_request(committed)
    output, _ = run_step(scheduler, runner)
    assert next(s for s in output.scheduled_requests if s.request_id == "f2").start_position == 8
    run_until_done(scheduler, runner)


def test_group_siblings_wait_for_one_prefill_then_hit_its_blocks() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=24, long_prefill_token_threshold=16)
    runner = FakeModelRunner(scheduler)
    num_prompt_tokens, n = 50, 4
    group = make_group("g", n, fresh_token_ids(num_prompt_tokens), max_tokens=3)
    other = make_request("other", num_prompt_tokens=4, max_tokens=3)
    for request in [*group, other]:
        scheduler.add_request(request)
    steps = [run_step(scheduler, runner)[0].num_scheduled_tokens for _ in range(4)]
    # Siblings wait while g/0 prefills; a request of another group is not held up.
    assert steps[:3] == [{"g/0": 16, "other": 4}, {"g/0": 16, "other": 1}, {"g/0": 16, "other": 1}]
    assert steps[3] == {"g/0": 2, "g/1": 2, "g/2": 2, "g/3": 2}
    num_prompt_positions = sum(s.get(r.request_id, 0) for s in steps for r in group)
    assert num_prompt_positions == num_prompt_tokens + (n - 1) * 2
    kv = scheduler.kv_cache_manager
    shared = kv.get_block_ids("g/0")[:12]
    assert all(kv.get_block_ids(r.request_id)[:12] == shared for r in group)
    assert all(kv.block_pool.blocks[i].ref_count == n for i in shared)
    run_until_done(scheduler, runner)
    for request in group:
        assert request.output_token_ids == expected_outputs(request.request_id, 50, 3)


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("num_prompt_tokens", [3, 17, 61])
def test_a_group_is_prefilled_once(n: int, num_prompt_tokens: int) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    runner = FakeModelRunner(scheduler)
    group = make_group("g", n, fresh_token_ids(num_prompt_tokens), max_tokens=2)
    for request in group:
        scheduler.add_request(request)
    num_prompt_positions = 0
    for output, _ in iterate_steps(scheduler, runner, max_steps=200):
        for scheduled in output.scheduled_requests:
            num_prompt_left = num_prompt_tokens - scheduled.start_position
            num_new = output.num_scheduled_tokens[scheduled.request_id]
            num_prompt_positions += max(0, min(num_new, num_prompt_left))
    block_size = scheduler.block_size
    assert num_prompt_positions <= num_prompt_tokens + (n - 1) * block_size
    for request in group:
        assert request.output_token_ids == expected_outputs(
            request.request_id, num_prompt_tokens, 2
        )


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_siblings_wait_for_a_prefill_only_when_they_can_share_it(enable_prefix_caching):
    scheduler = make_scheduler(enable_prefix_caching=enable_prefix_caching)
    for request in make_group("g", 3, fresh_token_ids(20)):
        scheduler.add_request(request)
    output = scheduler.schedule()
    # With caching, the first sibling prefills and the others reuse its blocks in the
    # same step; without, each sibling prefills on its own.
    expected = [20, 4, 4] if enable_prefix_caching else [20, 20, 20]
    assert [output.num_scheduled_tokens[f"g/{j}"] for j in range(3)] == expected
