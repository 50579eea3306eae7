"""The KV connector in the ledger (prefill–decode disaggregation), with a stand-in runner.

A transfer is played by writing the prompt's KV values into the fake runner's cache, as a
real transfer writes what the prefill engine computed. The fake runner checks every KV read,
so a request that hits a block whose transfer has not landed reads "unwritten" and fails.
"""

from __future__ import annotations

import pytest

from rollout_engine.core.request import Request, RequestStatus
from rollout_engine.core.scheduler import Scheduler
from rollout_engine.core.scheduler_output import KVLoad
from rollout_engine.protocol import KVTransferParams, SamplingParams
from tests.unit.factories import (
    FakeModelRunner,
    check_ledger_invariants,
    fresh_token_ids,
    iterate_async_steps,
    make_request,
    make_scheduler,
    prefix_hashes,
    run_step,
    run_until_done,
    token_for,
)

BS = 4


def handle(num_tokens: int) -> KVTransferParams:
    """A decode-side handle (the ledger only reads num_tokens)."""
    return KVTransferParams(
        do_remote_prefill=True, transfer_id="t", transport="shm", location="x",
        num_tokens=num_tokens,
    )


def decode_request(request_id: str, prompt: list[int], *, max_tokens: int = 6, n: int = 1,
                   group_id: str | None = None, sample_index: int = 0) -> Request:
    params = SamplingParams(
        max_tokens=max_tokens, n=n, kv_transfer_params=handle(len(prompt) - 1)
    )
    return Request(request_id, prompt, params, group_id=group_id, sample_index=sample_index)


def land_transfer(runner: FakeModelRunner, load: KVLoad, prompt: list[int]) -> None:
    """What a completed transfer does: the prefill engine's KV lands in the load's blocks."""
    chain = prefix_hashes(prompt)
    for pos in range(load.start_position, load.start_position + load.num_tokens):
        runner.kv[load.block_ids[pos // BS]][pos % BS] = chain[pos]


def expected_tokens(request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    return [token_for(request_id, len(prompt) + i) for i in range(max_tokens)]


def assert_no_leak(scheduler: Scheduler) -> None:
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_free_blocks == scheduler.num_blocks


def test_a_loaded_prompt_computes_only_its_last_token():
    scheduler = make_scheduler(block_size=BS)
    runner = FakeModelRunner(scheduler)
    prompt = fresh_token_ids(10)
    request = decode_request("d", prompt)
    scheduler.add_request(request)

    output, _ = run_step(scheduler, runner)
    assert output.is_empty and len(output.kv_loads) == 1
    load = output.kv_loads[0]
    assert (load.request_id, load.start_position, load.num_tokens) == ("d", 0, 9)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert request.num_computed_tokens == 0 and request.num_external_computed_tokens == 9
    check_ledger_invariants(scheduler)
    output, _ = run_step(scheduler, runner)  # still in flight: nothing to do
    assert output.is_empty and not output.kv_loads

    land_transfer(runner, load, prompt)
    scheduler.finish_kv_load("d", succeeded=True)
    check_ledger_invariants(scheduler)
    assert request.num_computed_tokens == 9
    output, _ = run_step(scheduler, runner)
    assert output.num_scheduled_tokens == {"d": 1}  # the last prompt token, for its logits
    run_until_done(scheduler, runner)
    assert request.output_token_ids == expected_tokens("d", prompt, 6)
    assert scheduler.kv_connector.num_loaded_tokens == 9 and scheduler.kv_connector.num_load_failures == 0
    assert_no_leak(scheduler)


@pytest.mark.parametrize("arrives", ["same_step", "during_transfer"])
def test_a_request_sharing_the_prefix_never_hits_blocks_still_in_flight(arrives):
    """The loading blocks are neither offered to the step that allocates them nor cached
    before the transfer lands: a sibling prompt computes its own KV (and the fake runner would
    fail it for reading unwritten KV otherwise). After the transfer, the prefix is shared."""
    scheduler = make_scheduler(block_size=BS)
    runner = FakeModelRunner(scheduler)
    prompt = fresh_token_ids(13)
    loading = decode_request("d", prompt)
    local = make_request("local", prompt, max_tokens=3)
    scheduler.add_request(loading)
    if arrives == "same_step":
        scheduler.add_request(local)
    output, _ = run_step(scheduler, runner)
    load = output.kv_loads[0]
    if arrives == "during_transfer":
        scheduler.add_request(local)
    run_until_done_or(scheduler, runner, lambda: local.is_finished)
    assert scheduler.num_prefix_hit_tokens == 0
    assert local.output_token_ids == expected_tokens("local", prompt, 3)

    land_transfer(runner, load, prompt)
    scheduler.finish_kv_load("d", succeeded=True)
    later = make_request("later", prompt, max_tokens=2)
    scheduler.add_request(later)
    run_until_done(scheduler, runner)
    assert later.num_computed_tokens >= 12  # hit the prompt's three full blocks
    assert scheduler.num_prefix_hit_tokens == 12
    assert loading.output_token_ids == expected_tokens("d", prompt, 6)
    assert_no_leak(scheduler)


def run_until_done_or(scheduler, runner, stop, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        if stop():
            return
        run_step(scheduler, runner)
        check_ledger_invariants(scheduler)
    raise AssertionError("did not finish")


def test_a_failed_transfer_has_the_prompt_computed_here():
    scheduler = make_scheduler(block_size=BS)
    runner = FakeModelRunner(scheduler)
    prompt = fresh_token_ids(11)
    request = decode_request("d", prompt)
    scheduler.add_request(request)
    run_step(scheduler, runner)
    scheduler.finish_kv_load("d", succeeded=False)  # the peer died, or it timed out
    check_ledger_invariants(scheduler)
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
    output, _ = run_step(scheduler, runner)
    assert output.num_scheduled_tokens == {"d": 11} and not output.kv_loads  # loads once
    run_until_done(scheduler, runner)
    assert request.output_token_ids == expected_tokens("d", prompt, 6)
    assert scheduler.kv_connector.num_load_failures == 1 and scheduler.kv_connector.num_loaded_tokens == 0
    assert_no_leak(scheduler)


def test_an_abort_during_the_transfer_frees_the_blocks_and_the_late_transfer_is_dropped():
    scheduler = make_scheduler(block_size=BS)
    runner = FakeModelRunner(scheduler)
    request = decode_request("d", fresh_token_ids(9))
    scheduler.add_request(request)
    run_step(scheduler, runner)
    assert scheduler.num_free_blocks < scheduler.num_blocks
    scheduler.finish_requests(["d"])
    assert scheduler.kv_connector.load_of("d") is None  # the engine writes nothing for it
    scheduler.finish_kv_load("d", succeeded=True)  # lands late: ignored
    check_ledger_invariants(scheduler)
    assert request.finish_reason == "abort"
    assert_no_leak(scheduler)


def test_one_sample_of_a_group_loads_and_its_siblings_hit_the_cache():
    scheduler = make_scheduler(block_size=BS)
    runner = FakeModelRunner(scheduler)
    prompt = fresh_token_ids(14)
    group = [decode_request(f"g/{j}", prompt, group_id="g", sample_index=j, n=3)
             for j in range(3)]
    for request in group:
        scheduler.add_request(request)
    output, _ = run_step(scheduler, runner)
    assert [load.request_id for load in output.kv_loads] == ["g/0"]
    output, _ = run_step(scheduler, runner)
    assert output.is_empty  # the siblings wait for the load instead of computing the prompt
    land_transfer(runner, scheduler.kv_connector.load_of("g/0"), prompt)
    scheduler.finish_kv_load("g/0", succeeded=True)
    run_until_done(scheduler, runner)
    assert scheduler.kv_connector.num_loaded_tokens == 13
    assert scheduler.num_prefix_hit_tokens == 2 * 12  # each sibling hit three full blocks
    for request in group:
        assert request.output_token_ids == expected_tokens(request.request_id, prompt, 6)
    assert_no_leak(scheduler)


def test_local_prefix_hits_are_not_transferred_again():
    scheduler = make_scheduler(block_size=BS)
    runner = FakeModelRunner(scheduler)
    prefix = fresh_token_ids(8)
    scheduler.add_request(make_request("warm", prefix + fresh_token_ids(3), max_tokens=1))
    run_until_done(scheduler, runner)
    prompt = prefix + fresh_token_ids(7)
    request = decode_request("d", prompt)
    scheduler.add_request(request)
    output, _ = run_step(scheduler, runner)
    load = output.kv_loads[0]
    assert (load.start_position, load.num_tokens) == (8, 6)  # two cached blocks kept
    land_transfer(runner, load, prompt)
    scheduler.finish_kv_load("d", succeeded=True)
    run_until_done(scheduler, runner)
    assert request.output_token_ids == expected_tokens("d", prompt, 6)
    assert_no_leak(scheduler)


def test_a_transfer_lands_between_async_steps():
    scheduler = make_scheduler(block_size=BS, async_scheduling=True)
    runner = FakeModelRunner(scheduler)
    other = make_request("other", max_tokens=8)
    scheduler.add_request(other)
    prompt = fresh_token_ids(10)
    request = decode_request("d", prompt)
    scheduler.add_request(request)

    def land_load(step) -> None:
        load = scheduler.kv_connector.load_of("d")
        if load is not None and step.kv_loads:
            land_transfer(runner, load, prompt)
            scheduler.finish_kv_load("d", succeeded=True)

    for _ in iterate_async_steps(scheduler, runner, before_landing=land_load):
        pass
    assert request.output_token_ids == expected_tokens("d", prompt, 6)
    assert other.output_token_ids == expected_tokens("other", other.prompt_token_ids, 8)
    assert_no_leak(scheduler)


def prefill_request(request_id: str, prompt: list[int]) -> Request:
    params = SamplingParams(max_tokens=1, kv_transfer_params=KVTransferParams(
        do_remote_decode=True))
    return Request(request_id, prompt, params)


def test_a_finished_prefill_holds_its_blocks_until_its_kv_is_saved():
    scheduler = make_scheduler(block_size=BS)
    runner = FakeModelRunner(scheduler)
    request = prefill_request("p", fresh_token_ids(10))
    scheduler.add_request(request)
    run_until_done(scheduler, runner)
    assert request.finish_reason == "length"
    assert [r.request_id for r in scheduler.kv_connector.take_to_save()] == ["p"]
    assert scheduler.num_free_blocks == scheduler.num_blocks - 3
    check_ledger_invariants(scheduler)
    scheduler.kv_connector.saved(request)
    assert not scheduler.kv_connector.take_to_save()
    assert_no_leak(scheduler)


def test_a_prefill_aborted_with_its_step_in_flight_saves_nothing():
    scheduler = make_scheduler(block_size=BS)
    runner = FakeModelRunner(scheduler)
    request = prefill_request("p", fresh_token_ids(10))
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.finish_requests(["p"])
    scheduler.update_from_output(output, runner.execute(output))
    assert request.finish_reason == "abort"
    assert not scheduler.kv_connector.take_to_save()
    assert_no_leak(scheduler)
