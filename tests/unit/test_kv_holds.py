"""A finished turn's KV kept warm for its conversation's next turn (`kv_keep_alive_s`): it
survives the LRU churn that evicts other freed blocks, the next turn takes it over, it expires,
and it yields to any request that needs the blocks."""

from __future__ import annotations

import pytest

from rollout_engine.protocol import InvalidRequestError, SamplingParams
from tests.unit.factories import (
    FakeModelRunner,
    check_ledger_invariants,
    fresh_token_ids,
    make_request,
    make_scheduler,
    run_step,
    run_until_done,
)

BLOCK_SIZE = 4


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def churn(scheduler, runner, num_requests: int, num_prompt_tokens: int) -> None:
    """Unrelated one-turn requests that cycle through the free queue (LRU eviction)."""
    for i in range(num_requests):
        scheduler.add_request(make_request(f"churn-{i}", num_prompt_tokens=num_prompt_tokens,
                                           max_tokens=1))
        run_until_done(scheduler, runner)


def next_turn_hit_tokens(scheduler, runner, turn, request_id: str) -> int:
    """Send the conversation's next turn (turn's tokens + a tool answer); its prefix hit."""
    following = make_request(request_id, turn.all_token_ids + fresh_token_ids(6), max_tokens=2)
    scheduler.add_request(following)
    output, _ = run_step(scheduler, runner)
    (scheduled,) = [s for s in output.scheduled_requests if s.request_id == request_id]
    return scheduled.start_position


@pytest.mark.parametrize("keep_alive_s", [0.0, 30.0])
def test_a_held_turn_survives_churn_that_evicts_an_unheld_one(keep_alive_s: float) -> None:
    clock = Clock()
    scheduler = make_scheduler(num_blocks=16, clock=clock)
    runner = FakeModelRunner(scheduler)
    turn = make_request("turn-1", num_prompt_tokens=21, max_tokens=3, kv_keep_alive_s=keep_alive_s)
    scheduler.add_request(turn)
    run_until_done(scheduler, runner)
    held = 5 if keep_alive_s else 0  # 23 computed positions: 5 full blocks
    assert scheduler.kv_cache_manager.holds.num_blocks == held
    assert scheduler.num_free_blocks == 16  # held blocks are still there for the taking
    churn(scheduler, runner, num_requests=6, num_prompt_tokens=24)
    check_ledger_invariants(scheduler)
    hit = next_turn_hit_tokens(scheduler, runner, turn, "turn-2")
    assert hit == (20 if keep_alive_s else 0)
    # The next turn took the blocks over: the hold is done.
    assert scheduler.kv_cache_manager.holds.num_blocks == 0
    run_until_done(scheduler, runner)
    check_ledger_invariants(scheduler)


def test_a_hold_ends_at_its_deadline_capped_by_the_engine() -> None:
    clock = Clock()
    scheduler = make_scheduler(num_blocks=16, clock=clock, max_kv_keep_alive_s=10.0)
    runner = FakeModelRunner(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=9, max_tokens=1,
                                       kv_keep_alive_s=1000.0))
    run_until_done(scheduler, runner)
    holds = scheduler.kv_cache_manager.holds
    assert len(holds) == 1
    clock.now_s += 9.9
    run_step(scheduler, runner)
    assert len(holds) == 1
    clock.now_s += 0.2  # past the engine's cap, long before the request's 1000 s
    run_step(scheduler, runner)
    assert len(holds) == 0 and scheduler.kv_cache_manager.block_pool.num_free_blocks == 16
    check_ledger_invariants(scheduler)


def test_an_aborted_turn_and_an_engine_that_holds_nothing_keep_nothing() -> None:
    scheduler = make_scheduler(num_blocks=16)
    runner = FakeModelRunner(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=12, max_tokens=8,
                                       kv_keep_alive_s=30.0))
    run_step(scheduler, runner)
    run_step(scheduler, runner)
    scheduler.finish_requests(["a"])
    run_until_done(scheduler, runner)
    assert len(scheduler.kv_cache_manager.holds) == 0
    off = make_scheduler(num_blocks=16, max_kv_keep_alive_s=0.0)
    off_runner = FakeModelRunner(off)
    off.add_request(make_request("b", num_prompt_tokens=12, max_tokens=1, kv_keep_alive_s=30.0))
    run_until_done(off, off_runner)
    assert len(off.kv_cache_manager.holds) == 0


def test_holds_yield_to_a_request_that_needs_the_blocks_oldest_first() -> None:
    scheduler = make_scheduler(num_blocks=8)
    runner = FakeModelRunner(scheduler)
    turns = {}
    for name in ("old", "new"):  # 8 prompt tokens + 1 output: 2 cached blocks each
        turns[name] = make_request(name, num_prompt_tokens=9, max_tokens=1, kv_keep_alive_s=30.0)
        scheduler.add_request(turns[name])
        run_until_done(scheduler, runner)
    holds = scheduler.kv_cache_manager.holds
    assert holds.num_blocks == 4 and scheduler.kv_cache_manager.block_pool.num_free_blocks == 4
    # 24 positions need 6 blocks: 4 free + the oldest hold's 2.
    big = make_request("big", num_prompt_tokens=23, max_tokens=2)
    scheduler.add_request(big)
    run_step(scheduler, runner)
    assert big.num_computed_tokens == 23 and not big.is_finished
    assert holds.num_blocks == 2
    check_ledger_invariants(scheduler)

    def num_hit_tokens(turn) -> int:
        probe = make_request(f"probe-{turn.request_id}", turn.all_token_ids + [1])
        return scheduler.kv_cache_manager.get_computed_blocks(probe)[1]

    assert num_hit_tokens(turns["old"]) == 0 and num_hit_tokens(turns["new"]) == 8
    # A request that cannot fit even with every hold released leaves the holds alone.
    kv = scheduler.kv_cache_manager
    too_big = make_request("too-big", num_prompt_tokens=12, max_tokens=1)
    assert not kv.allocate_slots(too_big, 12)
    assert holds.num_blocks == 2
    run_until_done(scheduler, runner)
    check_ledger_invariants(scheduler)


def test_reset_prefix_cache_releases_every_hold() -> None:
    scheduler = make_scheduler(num_blocks=16)
    runner = FakeModelRunner(scheduler)
    scheduler.add_request(make_request("a", num_prompt_tokens=9, max_tokens=1,
                                       kv_keep_alive_s=30.0))
    run_until_done(scheduler, runner)
    scheduler.reset_prefix_cache()
    assert len(scheduler.kv_cache_manager.holds) == 0
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 16
    check_ledger_invariants(scheduler)


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True])
def test_kv_keep_alive_must_be_a_finite_non_negative_number(value) -> None:
    with pytest.raises(InvalidRequestError, match="kv_keep_alive_s"):
        SamplingParams(kv_keep_alive_s=value)
