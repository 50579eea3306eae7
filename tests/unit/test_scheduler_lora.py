"""The scheduler's LoRA rules: at most `max_loras` adapters run at once (a request of another
adapter waits, others go ahead), and prefix-cache entries are per adapter."""

from __future__ import annotations

import pytest

from rollout_engine.core.block_pool import ROOT_HASH, root_hash
from rollout_engine.protocol import InvalidRequestError
from tests.unit.factories import (
    FakeModelRunner,
    fresh_token_ids,
    iterate_steps,
    make_request,
    make_scheduler,
    run_until_done,
)


def test_at_most_max_loras_adapters_run_at_once():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.max_loras = 2
    runner = FakeModelRunner(scheduler)
    adapters = [1, 2, 3, 0, 1, 3, 0, 2]
    requests = [make_request(f"r{i}", max_tokens=4 + i) for i in range(len(adapters))]
    for request, lora_id in zip(requests, adapters):
        request.lora_id = lora_id
        scheduler.add_request(request)
    seen_running = []
    for output, _ in iterate_steps(scheduler, runner):
        scheduled = {rid: requests[int(rid[1:])].lora_id for rid in output.num_scheduled_tokens}
        seen_running.append(set(scheduled.values()) - {0})
        assert len(seen_running[-1]) <= 2
        if len(seen_running) == 1:  # adapter 3 waits; the base requests are not held back
            assert {"r3", "r6"} <= set(scheduled) and "r2" not in scheduled
    assert all(r.is_finished for r in requests)
    assert any(3 in running for running in seen_running)  # adapter 3 ran, later
    assert seen_running[0] == {1, 2}


def test_prefix_cache_entries_are_per_adapter():
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=True)
    scheduler.max_loras = 1
    runner = FakeModelRunner(scheduler)
    prompt = fresh_token_ids(13)
    expected_hits = {("base", 0): 0, ("lora", 1): 0, ("base-again", 0): 12, ("lora-again", 1): 12,
                     ("other", 2): 0}
    for (name, lora_id), hits in expected_hits.items():
        request = make_request(name, prompt, max_tokens=2)
        request.lora_id = lora_id
        scheduler.add_request(request)
        run_until_done(scheduler, runner)
        assert request.num_cached_tokens == hits, name
    assert root_hash(0) == ROOT_HASH and len({root_hash(i) for i in range(4)}) == 4


def test_a_lora_request_without_lora_is_refused():
    scheduler = make_scheduler()
    request = make_request("r")
    request.lora_id = 1
    with pytest.raises(InvalidRequestError, match="max_loras"):
        scheduler.add_request(request)
