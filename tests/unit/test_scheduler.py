"""Ledger-level tests of the scheduler: budgets, chunking, drafts, stops, refusals."""

from __future__ import annotations

import random

import pytest

from rollout_engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from rollout_engine.core.request import RequestStatus
from rollout_engine.core.scheduler import Scheduler
from rollout_engine.core.scheduler_output import NO_ALLOWED_TOKEN_ID
from rollout_engine.protocol import InvalidRequestError, OutOfBlocksError
from tests.unit.factories import (
    FakeModelRunner,
    check_ledger_invariants,
    expected_outputs,
    iterate_steps,
    make_request,
    make_scheduler,
    run_step,
    run_until_done,
    token_for,
)

EOS = 2


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
    assert scheduled.needs_sample
    assert request.num_computed_tokens == 29 + k + 1  # optimistic: 32 for k = 2

    runner_output = runner.execute(output)
    assert runner.last_step["D"].input_token_ids == [request.all_token_ids[-1]] + drafts
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
        assert scheduled.needs_sample is is_last
        runner_output = runner.execute(output)
        inputs = runner.last_step["long"].input_token_ids
        assert inputs == request.prompt_token_ids[start : start + num_new]
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


def test_a_position_without_an_allowed_token_ends_only_its_request() -> None:
    """The sampler's NO_ALLOWED_TOKEN_ID (a constraint that dead-ended) is never appended: the
    request ends as "abort", marked for the engine to raise; the others go on."""

    def dead_end_at_third_output(request_id: str, position: int) -> int:
        if request_id == "dead" and position == 8 + 2:
            return NO_ALLOWED_TOKEN_ID
        return token_for(request_id, position)

    scheduler = make_scheduler(eos_token_ids=[EOS])
    runner = FakeModelRunner(scheduler, token_fn=dead_end_at_third_output)
    dead = make_request("dead", num_prompt_tokens=8, max_tokens=10)
    other = make_request("other", num_prompt_tokens=8, max_tokens=10)
    scheduler.add_request(dead)
    scheduler.add_request(other)
    run_until_done(scheduler, runner)
    assert dead.finish_reason == "abort" and dead.is_dead_ended
    assert dead.output_token_ids == expected_outputs("dead", 8, 2)
    assert len(dead.output_logprobs) == 2
    assert other.finish_reason == "length" and not other.is_dead_ended
    assert other.output_token_ids == expected_outputs("other", 8, 10)
    assert scheduler.num_free_blocks == scheduler.num_blocks


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


class StopAtToken:
    """A stand-in stop checker: "matches" when it reads `token` (the engine's decodes text)."""

    def __init__(self, token: int, min_tokens: int = 0) -> None:
        self.token, self.min_tokens, self.num_read = token, min_tokens, 0
        self.stop_string: str | None = None

    def accept(self, token_id: int) -> str | None:
        self.num_read += 1
        if token_id == self.token and self.num_read >= self.min_tokens:
            self.stop_string = "</stop>"
        return self.stop_string


def test_a_stop_string_inside_accepted_drafts_ends_there_and_reads_every_token() -> None:
    scheduler = make_scheduler(eos_token_ids=[EOS], num_speculative_tokens=3)
    runner = FakeModelRunner(scheduler, num_accepted=3)
    request = make_request("r", num_prompt_tokens=6, max_tokens=20)
    request.stop_checker = checker = StopAtToken(6002)
    scheduler.add_request(request)
    run_step(scheduler, runner)
    request.spec_token_ids = [6001, 6002, 6003]
    run_step(scheduler, runner)
    assert request.finish_reason == "stop" and request.stop_str == "</stop>"
    assert request.output_token_ids == [token_for("r", 6), 6001, 6002]
    assert checker.num_read == 3  # the token after the match is dropped, unread
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_before_min_tokens_only_the_length_stops_a_request() -> None:
    scheduler = make_scheduler(eos_token_ids=[EOS])
    runner = FakeModelRunner(scheduler, token_fn=eos_at("r", 8 + 1))
    request = make_request("r", num_prompt_tokens=8, max_tokens=10, min_tokens=4)
    scheduler.add_request(request)
    run_until_done(scheduler, runner)  # the sampler masks EOS there; the ledger must not stop
    assert request.finish_reason == "length" and request.output_token_ids[1] == EOS


class AcceptingGrammar:
    """A stand-in ready grammar that accepts every token (the sampler's mask is not run)."""

    is_ready, error, is_terminated = True, None, False

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True


def test_a_constrained_request_ends_at_its_eos_even_before_min_tokens() -> None:
    """A complete grammar allows only EOS, and the sampler lets it through before min_tokens
    (vLLM's rule): the EOS ends the request, and is its last output token."""
    scheduler = make_scheduler(eos_token_ids=[EOS])
    runner = FakeModelRunner(scheduler, token_fn=eos_at("r", 8 + 2))
    request = make_request("r", num_prompt_tokens=8, max_tokens=10, min_tokens=6)
    request.grammar = grammar = AcceptingGrammar()
    scheduler.add_request(request)
    run_until_done(scheduler, runner)
    assert request.finish_reason == "stop" and request.output_token_ids[-1] == EOS
    assert len(request.output_token_ids) == 3 and grammar.accepted == request.output_token_ids


def test_prompt_logprobs_keep_the_prefix_cache_off_the_positions_asked_for() -> None:
    """A prompt whose logprobs are asked for computes every position that predicts one, even
    with its blocks cached; once they landed, a preempted request may hit the cache again."""
    scheduler = make_scheduler()
    runner = FakeModelRunner(scheduler)
    first = make_request("first", num_prompt_tokens=16, max_tokens=2)
    scheduler.add_request(first)
    run_until_done(scheduler, runner)
    asking = make_request("asking", first.prompt_token_ids, max_tokens=2)
    asking.prompt_logprobs = [None] * 16
    asking.prompt_logprobs_start = 9  # positions 9..15 (scoring a completion, say)
    scheduler.add_request(asking)
    output = scheduler.schedule()
    # Positions 0..7 may come from the cache (they predict nothing asked for); not 8.
    assert output.num_scheduled_tokens["asking"] == 16 - 8
    asking.set_prompt_logprobs(9, [object()] * 7)
    assert asking.max_prefix_hit_tokens == 16 - 1 + asking.num_output_tokens


def test_a_paused_scheduler_schedules_nothing_and_frozen_requests_resume_by_recompute() -> None:
    """Keep mode in ledger terms: frozen requests are preempted by recompute (blocks freed,
    tokens kept, no new state); the worker hears of them; resumed, they recompute and go on,
    their tokens recorded with the weight version of the steps that sampled them."""
    scheduler = make_scheduler()
    runner = FakeModelRunner(scheduler)
    requests = [make_request(f"r{i}", num_prompt_tokens=8, max_tokens=6) for i in range(2)]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(3):
        run_step(scheduler, runner)
    num_before = [r.num_output_tokens for r in requests]
    scheduler.is_paused = True
    assert scheduler.preempt_all_running() == 2
    assert scheduler.num_free_blocks == scheduler.num_blocks
    assert all(r.num_computed_tokens == 0 and r.num_output_tokens == n
               for r, n in zip(requests, num_before))
    output, _ = run_step(scheduler, runner)
    assert output.total_num_scheduled_tokens == 0
    assert sorted(output.preempted_request_ids) == ["r0", "r1"]  # the worker drops them
    scheduler.is_paused = False
    scheduler.weight_version = 1
    run_until_done(scheduler, runner)
    for request, n in zip(requests, num_before):
        assert request.output_token_ids == expected_outputs(request.request_id, 8, 6)
        assert [(s.version, s.start, s.end) for s in request.weight_versions] == [
            (0, 0, n), (1, n, 6)]


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
        peak = max(peak, len(runner.last_step["r"].block_ids))
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
