"""Ledger-level tests of the scheduler: budgets, chunking, drafts, stops, preemption, caching."""

from __future__ import annotations

import random

import pytest

from rollout_engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from rollout_engine.errors import InvalidRequestError, OutOfBlocksError
from rollout_engine.request import RequestStatus
from rollout_engine.scheduler import Scheduler
from tests.unit.factories import (
    FakeModelRunner,
    check_ledger_invariants,
    fresh_token_ids,
    iterate_steps,
    make_group,
    make_request,
    make_scheduler,
    run_step,
    run_until_done,
    token_for,
)

EOS = 2


def expected_outputs(request_id: str, num_prompt_tokens: int, num_outputs: int) -> list[int]:
    return [token_for(request_id, num_prompt_tokens + i) for i in range(num_outputs)]


# ---------------------------------------------------------------- the worked examples
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_worked_example_one_budget_for_decode_prefill_and_new_request(
    enable_prefix_caching: bool,
) -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=6, enable_prefix_caching=enable_prefix_caching
    )
    runner = FakeModelRunner(scheduler)
    p = make_request("P", num_prompt_tokens=18, max_tokens=100)
    scheduler.add_request(p)
    for _ in range(3):  # chunks of 6; the last one reaches the prompt's end
        run_step(scheduler, runner)
    assert (p.num_tokens, p.num_computed_tokens) == (19, 18)
    q = make_request("Q", num_prompt_tokens=9, max_tokens=100)
    scheduler.add_request(q)
    output, _ = run_step(scheduler, runner)
    assert output.num_scheduled_tokens == {"P": 1, "Q": 5}
    assert (p.num_tokens, p.num_computed_tokens) == (20, 19)
    assert (q.num_tokens, q.num_computed_tokens) == (9, 5)

    r = make_request("R", num_prompt_tokens=7, max_tokens=100)
    scheduler.add_request(r)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"P": 1, "Q": 4, "R": 1}
    assert [s.request_id for s in output.scheduled_requests] == ["P", "Q", "R"]
    assert output.total_num_scheduled_tokens == 6
    assert [p.num_computed_tokens, q.num_computed_tokens, r.num_computed_tokens] == [20, 9, 1]
    assert [s.needs_sample for s in output.scheduled_requests] == [True, True, False]
    runner_output = runner.execute(output)
    assert set(runner_output.sampled_token_ids) == {"P", "Q"}
    updated = scheduler.update_from_output(output, runner_output)
    assert {u.request_id for u in updated} == {"P", "Q"}
    assert (p.num_tokens, q.num_tokens, r.num_tokens) == (21, 10, 7)
    assert p.num_tokens - p.num_computed_tokens == 1
    assert q.num_tokens - q.num_computed_tokens == 1
    assert r.output_token_ids == [] and r.status is RequestStatus.RUNNING
    check_ledger_invariants(scheduler)


DRAFT_CASES = [(k, a) for k in (2, 4) for a in range(k + 1)]


@pytest.mark.parametrize(("k", "num_accepted"), DRAFT_CASES)
def test_worked_example_drafts_roll_back_rejected_positions(k: int, num_accepted: int) -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=256),
        CacheConfig(block_size=4, num_blocks=64),
        SpeculativeConfig(num_speculative_tokens=k),
    )
    runner = FakeModelRunner(scheduler, num_accepted=num_accepted)
    request = make_request("D", num_prompt_tokens=29, max_tokens=100)
    scheduler.add_request(request)
    run_step(scheduler, runner)
    assert (request.num_tokens, request.num_computed_tokens) == (30, 29)

    drafts = [5000 + i for i in range(k)]
    request.spec_token_ids = list(drafts)
    assert request.num_tokens_with_spec == 30 + k
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"D": k + 1}
    assert output.scheduled_spec_decode_tokens == {"D": drafts}
    (scheduled,) = output.scheduled_requests
    assert scheduled.start_position == 29 and scheduled.num_spec_tokens == k
    assert scheduled.input_token_ids == [request.all_token_ids[-1]] + drafts
    assert scheduled.needs_sample
    assert request.num_computed_tokens == 29 + k + 1  # optimistic: 32 for k = 2

    runner_output = runner.execute(output)
    sampled = runner_output.sampled_token_ids["D"]
    assert sampled == drafts[:num_accepted] + [token_for("D", 30 + num_accepted)]
    scheduler.update_from_output(output, runner_output)
    assert request.num_computed_tokens == 29 + (k + 1) - (k - num_accepted) == 30 + num_accepted
    assert request.num_tokens == 30 + num_accepted + 1
    assert request.num_tokens - request.num_computed_tokens == 1
    assert request.output_token_ids[1:] == sampled
    assert request.spec_token_ids == []
    check_ledger_invariants(scheduler)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_uncomputed_token_after_every_decode_step(seed: int) -> None:
    rng = random.Random(seed)
    k = 3
    scheduler = make_scheduler(num_speculative_tokens=k, max_num_batched_tokens=32)
    runner = FakeModelRunner(scheduler)  # accepts drafts that match its own tokens
    requests = [make_request(f"r{i}", num_prompt_tokens=5 + 3 * i, max_tokens=60) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    for _, updated in iterate_steps(scheduler, runner, max_steps=200):
        for request in updated:
            if not request.is_finished:
                assert request.num_tokens - request.num_computed_tokens == 1, request
        for request in scheduler.running:
            num_drafts = rng.randint(0, k)
            good = [token_for(request.request_id, request.num_tokens + i) for i in range(k)]
            request.spec_token_ids = [t if rng.random() < 0.6 else 7 for t in good[:num_drafts]]
    assert 0 < runner.num_drafts_accepted < runner.num_drafts_scheduled
    for request in requests:
        assert request.output_token_ids == expected_outputs(
            request.request_id, request.num_prompt_tokens, 60
        )


# ---------------------------------------------------------------- chunked prefill and limits
def test_chunked_prefill_yields_a_token_only_after_the_last_chunk() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    runner = FakeModelRunner(scheduler)
    request = make_request("long", num_prompt_tokens=20, max_tokens=4)
    scheduler.add_request(request)
    for start, num_new, is_last in [(0, 8, False), (8, 8, False), (16, 4, True)]:
        output = scheduler.schedule()
        (scheduled,) = output.scheduled_requests
        assert (scheduled.start_position, output.num_scheduled_tokens["long"]) == (start, num_new)
        assert scheduled.input_token_ids == request.prompt_token_ids[start : start + num_new]
        assert scheduled.needs_sample is is_last
        runner_output = runner.execute(output)
        assert ("long" in runner_output.sampled_token_ids) is is_last
        updated = scheduler.update_from_output(output, runner_output)
        assert request.num_computed_tokens == start + num_new
        assert request.num_output_tokens == int(is_last)
        assert (updated == [request]) is is_last


def test_decodes_are_served_before_a_prefill_chunk() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    runner = FakeModelRunner(scheduler)
    short = make_request("short", num_prompt_tokens=3, max_tokens=20)
    scheduler.add_request(short)
    run_step(scheduler, runner)
    scheduler.add_request(make_request("long", num_prompt_tokens=30))
    for _ in range(3):
        output, _ = run_step(scheduler, runner)
        assert output.num_scheduled_tokens == {"short": 1, "long": 7}


def test_long_prefill_token_threshold_caps_each_chunk() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    runner = FakeModelRunner(scheduler)
    a = make_request("a", num_prompt_tokens=12)
    b = make_request("b", num_prompt_tokens=12)
    scheduler.add_request(a)
    scheduler.add_request(b)
    steps = [run_step(scheduler, runner)[0].num_scheduled_tokens for _ in range(4)]
    assert steps == [{"a": 5, "b": 5}, {"a": 5, "b": 5}, {"a": 2, "b": 2}, {"a": 1, "b": 1}]


def test_max_num_seqs_limits_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeModelRunner(scheduler)
    requests = [make_request(f"r{i}", num_prompt_tokens=4, max_tokens=2 + i) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    output, _ = run_step(scheduler, runner)
    assert set(output.num_scheduled_tokens) == {"r0", "r1"}
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    output, _ = run_step(scheduler, runner)  # r0 finishes (max_tokens 2)
    assert set(output.num_scheduled_tokens) == {"r0", "r1"} and requests[0].is_finished
    output, _ = run_step(scheduler, runner)
    assert set(output.num_scheduled_tokens) == {"r1", "r2"}
    run_until_done(scheduler, runner)
    assert [r.num_output_tokens for r in requests] == [2, 3, 4]


def test_finish_length_at_max_model_len() -> None:
    scheduler = make_scheduler(max_model_len=16)
    runner = FakeModelRunner(scheduler)
    request = make_request("r", num_prompt_tokens=12, max_tokens=100)
    scheduler.add_request(request)
    run_until_done(scheduler, runner)
    assert request.finish_reason == "length"
    assert request.num_tokens == 16 and request.num_output_tokens == 4


@pytest.mark.parametrize(
    ("num_prompt_tokens", "num_drafts_kept"), [(27, 3), (28, 3), (29, 2), (30, 1)]
)
def test_drafts_are_trimmed_at_the_model_length_cap(
    num_prompt_tokens: int, num_drafts_kept: int
) -> None:
    max_model_len, k = 32, 3
    scheduler = make_scheduler(max_model_len=max_model_len, num_speculative_tokens=k)
    runner = FakeModelRunner(scheduler, num_accepted=k)
    request = make_request("r", num_prompt_tokens=num_prompt_tokens, max_tokens=100)
    scheduler.add_request(request)
    run_step(scheduler, runner)
    drafts = [6001, 6002, 6003]
    request.spec_token_ids = list(drafts)
    output, _ = run_step(scheduler, runner)
    (scheduled,) = output.scheduled_requests
    assert scheduled.num_spec_tokens == num_drafts_kept
    assert output.scheduled_spec_decode_tokens["r"] == drafts[:num_drafts_kept]
    assert scheduled.start_position + output.num_scheduled_tokens["r"] <= max_model_len
    assert request.num_tokens <= max_model_len
    if request.num_tokens == max_model_len:
        assert request.finish_reason == "length"
    assert (
        request.output_token_ids[1 : 1 + num_drafts_kept]
        == drafts[:num_drafts_kept][: request.num_output_tokens - 1]
    )


def test_max_tokens_cuts_accepted_drafts() -> None:
    scheduler = make_scheduler(num_speculative_tokens=4)
    runner = FakeModelRunner(scheduler, num_accepted=4)
    request = make_request("r", num_prompt_tokens=6, max_tokens=3)
    scheduler.add_request(request)
    run_step(scheduler, runner)
    request.spec_token_ids = [6001, 6002, 6003, 6004]
    run_step(scheduler, runner)
    assert request.finish_reason == "length"
    assert request.output_token_ids == [token_for("r", 6), 6001, 6002]
    assert len(request.output_logprobs) == 3
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


# ---------------------------------------------------------------- stop conditions
def eos_at(request_id: str, eos_position: int):
    """A token function that emits EOS at one position of one request."""

    def token_fn(rid: str, position: int) -> int:
        return EOS if (rid, position) == (request_id, eos_position) else token_for(rid, position)

    return token_fn


def test_eos_stops_and_is_kept() -> None:
    scheduler = make_scheduler(eos_token_ids=[EOS])
    runner = FakeModelRunner(scheduler, token_fn=eos_at("r", 8 + 3))
    request = make_request("r", num_prompt_tokens=8, max_tokens=10)
    scheduler.add_request(request)
    run_until_done(scheduler, runner)
    assert request.finish_reason == "stop"
    assert request.output_token_ids == expected_outputs("r", 8, 3) + [EOS]


def test_ignore_eos_keeps_generating() -> None:
    scheduler = make_scheduler(eos_token_ids=[EOS])
    runner = FakeModelRunner(scheduler, token_fn=eos_at("r", 8 + 3))
    request = make_request("r", num_prompt_tokens=8, max_tokens=10, ignore_eos=True)
    scheduler.add_request(request)
    run_until_done(scheduler, runner)
    assert request.finish_reason == "length" and request.num_output_tokens == 10
    assert request.output_token_ids[3] == EOS


def test_eos_is_an_ordinary_token_without_runtime_limits() -> None:
    scheduler = make_scheduler()
    runner = FakeModelRunner(scheduler, token_fn=eos_at("r", 8 + 3))
    request = make_request("r", num_prompt_tokens=8, max_tokens=10)
    scheduler.add_request(request)
    run_until_done(scheduler, runner)
    assert request.finish_reason == "length" and request.num_output_tokens == 10


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    scheduler = make_scheduler(eos_token_ids=[EOS])
    runner = FakeModelRunner(scheduler)
    stop_token = token_for("r", 8 + 2)
    request = make_request(
        "r", num_prompt_tokens=8, max_tokens=10, stop_token_ids=[stop_token], ignore_eos=True
    )
    scheduler.add_request(request)
    run_until_done(scheduler, runner)
    assert request.finish_reason == "stop"
    assert request.output_token_ids == expected_outputs("r", 8, 3)


@pytest.mark.parametrize("use_stop_token_ids", [False, True])
def test_a_stop_token_inside_accepted_drafts_discards_what_follows(
    use_stop_token_ids: bool,
) -> None:
    stop = 4242 if use_stop_token_ids else EOS
    scheduler = make_scheduler(eos_token_ids=[EOS], num_speculative_tokens=3)
    runner = FakeModelRunner(scheduler, num_accepted=3)
    stop_ids = [stop] if use_stop_token_ids else []
    request = make_request("r", num_prompt_tokens=6, max_tokens=20, stop_token_ids=stop_ids)
    scheduler.add_request(request)
    run_step(scheduler, runner)
    request.spec_token_ids = [6001, stop, 6003]
    _, updated = run_step(scheduler, runner)
    assert updated == [request] and request.finish_reason == "stop"
    assert request.output_token_ids == [token_for("r", 6), 6001, stop]
    assert len(request.output_logprobs) == 3
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
    assert "r" in scheduler.schedule().finished_request_ids


# ---------------------------------------------------------------- draft slots and budget
def test_a_long_prompt_leaves_room_for_drafts() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, num_speculative_tokens=3)
    runner = FakeModelRunner(scheduler)
    scheduler.add_request(make_request("long", num_prompt_tokens=40, max_tokens=2))
    chunks = [o.num_scheduled_tokens["long"] for o, _ in iterate_steps(scheduler, runner, 20)]
    assert chunks[:4] == [13, 13, 13, 1]


def test_drafts_never_exceed_the_budget() -> None:
    k = 4
    scheduler = make_scheduler(max_num_batched_tokens=12, num_speculative_tokens=k)
    runner = FakeModelRunner(scheduler, num_accepted=0)
    requests = [make_request(f"r{i}", num_prompt_tokens=4, max_tokens=20) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    output, _ = run_step(scheduler, runner)
    assert output.num_scheduled_tokens == {"r0": 4, "r1": 4, "r2": 4}
    drafts = {r.request_id: [7000 + 10 * i + j for j in range(k)] for i, r in enumerate(requests)}
    for request in requests:
        request.spec_token_ids = list(drafts[request.request_id])
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"r0": 5, "r1": 5, "r2": 2}
    assert output.total_num_scheduled_tokens == 12
    assert output.scheduled_spec_decode_tokens == {
        "r0": drafts["r0"],
        "r1": drafts["r1"],
        "r2": drafts["r2"][:1],
    }
    assert requests[2].spec_token_ids == drafts["r2"][:1]
    scheduler.update_from_output(output, runner.execute(output))
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in requests)


def test_drafts_are_dropped_when_the_budget_ends_before_the_last_token() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8, num_speculative_tokens=2)
    runner = FakeModelRunner(scheduler)
    long_prompt = make_request("long", num_prompt_tokens=30)
    scheduler.add_request(long_prompt)
    run_step(scheduler, runner)
    long_prompt.spec_token_ids = [1, 2]  # nonsense drafts on a request still in prefill
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"long": 6}
    assert output.scheduled_spec_decode_tokens == {}
    assert long_prompt.spec_token_ids == []
    scheduler.update_from_output(output, runner.execute(output))
    assert long_prompt.num_output_tokens == 0 and long_prompt.num_computed_tokens == 12


# ---------------------------------------------------------------- refusals and construction
def test_add_request_refuses_a_duplicate_id() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    with pytest.raises(InvalidRequestError, match="already in use"):
        scheduler.add_request(make_request("a"))
    assert scheduler.num_unfinished_requests == 1 and len(scheduler.waiting) == 1
    run_until_done(scheduler, FakeModelRunner(scheduler))
    scheduler.add_request(make_request("a"))  # a finished id may be reused
    assert scheduler.num_unfinished_requests == 1


@pytest.mark.parametrize("num_prompt_tokens", [32, 33, 100])
def test_add_request_refuses_a_prompt_without_room_to_generate(num_prompt_tokens: int) -> None:
    scheduler = make_scheduler(max_model_len=32)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        scheduler.add_request(make_request("r", num_prompt_tokens=num_prompt_tokens))
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request(make_request("ok", num_prompt_tokens=31))


def test_add_request_refuses_a_request_that_can_never_fit_the_pool() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=4)
    with pytest.raises(OutOfBlocksError, match="KV blocks"):
        scheduler.add_request(make_request("r", num_prompt_tokens=10, max_tokens=10))
    assert not scheduler.has_unfinished_requests() and not scheduler.waiting


def peak_num_blocks(num_prompt_tokens: int, max_tokens: int, k: int, max_model_len: int) -> int:
    """Blocks a request holds at most, measured on a large pool with k drafts every step."""
    scheduler = make_scheduler(
        max_model_len=max_model_len, num_speculative_tokens=k, num_blocks=256
    )
    runner = FakeModelRunner(scheduler, num_accepted=0)
    request = make_request("r", num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens)
    scheduler.add_request(request)
    peak = 0
    for output, _ in iterate_steps(scheduler, runner, max_steps=200):
        peak = max(peak, len(output.scheduled_requests[0].block_ids))
        request.spec_token_ids = [1] * k
    return peak


@pytest.mark.parametrize(
    ("num_prompt_tokens", "max_tokens", "k", "max_model_len"),
    [(20, 13, 0, 64), (20, 11, 2, 64), (20, 50, 2, 32)],
)
def test_add_request_accepts_a_request_that_fits_the_pool_exactly(
    num_prompt_tokens: int, max_tokens: int, k: int, max_model_len: int
) -> None:
    peak = peak_num_blocks(num_prompt_tokens, max_tokens, k, max_model_len)
    assert peak == 8  # 32 positions at most: see the arithmetic below
    # The last sampled token never gets KV: positions <= prompt + max_tokens - 1 + k, and
    # never beyond max_model_len. A pool of `peak` blocks therefore always suffices.
    scheduler = make_scheduler(
        max_model_len=max_model_len, num_speculative_tokens=k, num_blocks=peak
    )
    request = make_request("r", num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens)
    scheduler.add_request(request)
    run_until_done(scheduler, FakeModelRunner(scheduler))
    assert request.finish_reason == "length"


def test_scheduler_config_checks() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_scheduler(max_num_batched_tokens=8, num_speculative_tokens=4)
    make_scheduler(max_num_batched_tokens=9, num_speculative_tokens=4)
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(num_blocks=None))
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(), CacheConfig(num_blocks=16))


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
    assert scheduled.input_token_ids == c.all_token_ids[start:21] and scheduled.needs_sample
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
    a_blocks = scheduled.block_ids[:2]  # revived from the free queue
    # A 28-token request takes 7 of the 8 blocks: the prompt's tail blocks go first.
    scheduler.add_request(make_request("x", num_prompt_tokens=28, max_tokens=1))
    run_until_done(scheduler, runner)
    c = make_request("c", prompt, max_tokens=1)
    scheduler.add_request(c)
    output, _ = run_step(scheduler, runner)
    (scheduled,) = output.scheduled_requests
    assert scheduled.start_position == 4
    assert scheduled.block_ids[0] == a_blocks[0]


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
