"""Drafting policy and acceptance counters of speculative decoding, at the ledger level."""

from __future__ import annotations

from rollout_engine.config import SpeculativeConfig
from rollout_engine.core.spec_decode import MIN_DRAFTS_TO_JUDGE, SpecDecoder
from tests.unit.factories import FakeModelRunner, make_request, make_scheduler

PERIOD = [7, 8, 9, 10, 11]


def periodic_token(request_id: str, position: int) -> int:
    """A "model" that continues a periodic text: n-gram drafts from its history are right."""
    return PERIOD[position % len(PERIOD)]


def draft(scheduler, decoder, num_running):
    """The engine's drafting step: the drafter proposes, the scheduler takes the drafts."""
    scheduler.update_draft_token_ids(decoder.propose(scheduler.requests_to_draft(), num_running))


def run(scheduler, runner, decoder, max_steps=500):
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        output = scheduler.schedule()
        runner_output = runner.execute(output)
        scheduler.update_from_output(output, runner_output)
        decoder.record(output, runner_output)
        draft(scheduler, decoder, len(scheduler.running))
    raise AssertionError("requests did not finish")


def make(k=3, disable_by_batch_size=32, **overrides):
    scheduler = make_scheduler(num_speculative_tokens=k, **overrides)
    config = SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=disable_by_batch_size)
    return scheduler, SpecDecoder(config, scheduler.max_model_len)


def periodic_prompt(length=20):
    return [PERIOD[i % len(PERIOD)] for i in range(length)]


def test_repeating_text_is_drafted_and_accepted_with_identical_outputs():
    outputs = {}
    for k in (0, 3):
        scheduler = make_scheduler(num_speculative_tokens=k)
        decoder = SpecDecoder(SpeculativeConfig(num_speculative_tokens=max(k, 1)), 256)
        runner = FakeModelRunner(scheduler, token_fn=periodic_token)
        request = make_request("r", periodic_prompt(), max_tokens=30)
        scheduler.add_request(request)
        if k:
            run(scheduler, runner, decoder)
            assert decoder.stats.num_drafts == runner.num_drafts_scheduled > 0
            assert decoder.stats.acceptance_rate == 1.0
            assert decoder.stats.mean_accepted_length > 3.0
            num_steps = runner.num_steps
        else:
            while scheduler.has_unfinished_requests():
                output = scheduler.schedule()
                scheduler.update_from_output(output, runner.execute(output))
            num_steps_plain = runner.num_steps
        outputs[k] = request.output_token_ids
    assert outputs[0] == outputs[3] and len(outputs[3]) == 30
    assert num_steps < num_steps_plain / 2, (num_steps, num_steps_plain)


def test_drafts_only_for_decoding_requests_and_capped_by_max_tokens():
    scheduler, decoder = make(k=4, max_num_batched_tokens=12)
    request = make_request("r", periodic_prompt(30), max_tokens=3)
    scheduler.add_request(request)
    runner = FakeModelRunner(scheduler, token_fn=periodic_token)
    output = scheduler.schedule()  # a 12-token chunk of the prompt
    scheduler.update_from_output(output, runner.execute(output))
    draft(scheduler, decoder, 1)
    assert request.spec_token_ids == []  # still prefilling
    while request.num_output_tokens == 0:
        output = scheduler.schedule()
        scheduler.update_from_output(output, runner.execute(output))
    draft(scheduler, decoder, 1)
    # 2 tokens may still come; the target adds one after the drafts: one draft at most.
    assert len(request.spec_token_ids) == 1


def test_drafting_is_off_above_the_batch_size_threshold():
    scheduler, decoder = make(k=3, disable_by_batch_size=2)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", periodic_prompt(), max_tokens=10))
    runner = FakeModelRunner(scheduler, token_fn=periodic_token)
    run(scheduler, runner, decoder)
    assert runner.num_drafts_scheduled == 0
    assert decoder.stats.num_disabled_steps > 0


def test_a_request_whose_drafts_keep_failing_stops_drafting():
    scheduler, decoder = make(k=4)
    scheduler.add_request(make_request("r", periodic_prompt(), max_tokens=100))
    runner = FakeModelRunner(scheduler, token_fn=periodic_token, num_accepted=0)
    run(scheduler, runner, decoder)
    assert MIN_DRAFTS_TO_JUDGE <= decoder.stats.num_drafts < MIN_DRAFTS_TO_JUDGE + 4
    assert decoder.stats.num_accepted_tokens == 0
