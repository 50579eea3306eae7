"""Generation that survives a weight update: pause and sleep in "keep" mode, per-token weight
versions, against the Hugging Face oracle under the old weights and then the new ones."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rollout_engine import (
    LLM,
    DeviceOutOfMemoryError,
    EngineBusyError,
    EngineSleepingError,
    InvalidRequestError,
    RequestOutputKind,
    SamplingParams,
)
from rollout_engine.engine.llm_engine import LLMEngine
from rollout_engine.protocol import WeightVersionSpan
from rollout_engine.tiny_model import build_tiny_model
from rollout_engine.worker.fault_injection import FaultInjector
from tests.integration.hf_oracle import hf_greedy

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42, 43, 44], list(range(60, 83))]
MAX_TOKENS = 12
SWITCH_AT = 5  # output tokens generated before the pause
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE_OPTIONS = {"block_size": 4, "num_blocks": 64, "max_num_batched_tokens": 16}


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory) -> Path:
    """The trainer's next policy: the same model with other weights."""
    return build_tiny_model(tmp_path_factory.mktemp("new") / "llama", "llama", "tiny", seed=7)


@pytest.fixture
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), **ENGINE_OPTIONS)


def add(engine: LLMEngine, prompts, params=GREEDY) -> list[str]:
    ids = [f"p{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params, RequestOutputKind.FINAL_ONLY)
    return ids


def step_until(engine: LLMEngine, done, outputs: dict) -> None:
    """Step, keeping final outputs, until `done()`."""
    while not done():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output


def num_generated(engine: LLMEngine, request_id: str) -> int:
    return engine.scheduler.requests[f"{request_id}/0"].num_output_tokens


def generate_across_a_switch(engine: LLMEngine, switch) -> dict:
    """Generate PROMPTS, calling `switch()` once every prompt has SWITCH_AT tokens."""
    ids, outputs = add(engine, PROMPTS), {}
    step_until(engine, lambda: all(num_generated(engine, i) >= SWITCH_AT for i in ids), outputs)
    assert not outputs
    switched_at = {i: num_generated(engine, i) for i in ids}
    switch()
    step_until(engine, lambda: len(outputs) == len(ids), outputs)
    return {i: (outputs[i].outputs[0], switched_at[i]) for i in ids}


def check_old_then_new(results: dict, old_dir, new_dir) -> None:
    """Tokens before the switch are the old policy's greedy ones; after it the new policy's,
    continued from the same prefix (their KV recomputed with the new weights)."""
    for (completion, k), prompt in zip(results.values(), PROMPTS):
        tokens = completion.token_ids
        assert tokens[:k] == hf_greedy(str(old_dir), prompt, k)
        assert tokens[k:] == hf_greedy(str(new_dir), prompt + tokens[:k], MAX_TOKENS - k)
        assert completion.weight_versions == [WeightVersionSpan(0, 0, k),
                                              WeightVersionSpan(1, k, MAX_TOKENS)]
        assert completion.weight_version == 1


def test_kept_requests_resume_with_the_new_weights(llm, llama_dir, new_dir):
    engine = llm.engine
    weights = load_file(str(new_dir / "model.safetensors"))

    def switch() -> None:
        engine.pause_generation("keep")
        assert engine.is_paused() and engine.step() == []  # nothing runs while paused
        engine.update_weights(weights)  # allowed while paused in keep mode
        engine.resume_generation()

    check_old_then_new(generate_across_a_switch(engine, switch), llama_dir, new_dir)
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks


def test_kept_requests_survive_a_level_2_sleep_and_an_update(llm, llama_dir, new_dir):
    engine = llm.engine
    weights = load_file(str(new_dir / "model.safetensors"))

    def train_phase() -> None:
        engine.sleep(level=2, mode="keep")
        assert engine.step() == [] and engine.num_unfinished_requests == len(PROMPTS)
        engine.wake_up(["weights"])
        engine.update_weights(weights)
        engine.wake_up(["kv_cache"])  # awake with valid weights: they go on by themselves

    check_old_then_new(generate_across_a_switch(engine, train_phase), llama_dir, new_dir)


def test_kept_requests_woken_without_an_update_wait_for_it_and_say_why(
    llm, llama_dir, new_dir, caplog
):
    """After sleep(level=2, mode="keep") a wake alone leaves the weights invalid: the kept
    requests stay frozen (never a token from discarded weights, and no error: the RL step
    pushes the weights next) and the engine says why: a warning at the wake, and info() awake,
    weights invalid, requests unfinished. A new request is refused with what to call; the
    update lets the kept ones go on by themselves."""
    engine = llm.engine
    weights = load_file(str(new_dir / "model.safetensors"))

    def train_phase() -> None:
        engine.sleep(level=2, mode="keep")
        with caplog.at_level(logging.WARNING, logger="rollout_engine.engine.llm_engine"):
            engine.wake_up()
        assert f"{len(PROMPTS)} kept requests wait for a weight update" in caplog.text
        info = engine.info()
        assert not info.is_sleeping and not info.weights_valid
        assert info.num_unfinished_requests == len(PROMPTS)
        assert engine.step() == [] and not engine.can_make_progress()
        with pytest.raises(EngineSleepingError, match="update_weights"):
            engine.add_request("late", PROMPTS[0], GREEDY)
        engine.update_weights(weights)

    check_old_then_new(generate_across_a_switch(engine, train_phase), llama_dir, new_dir)


def test_a_request_sent_during_the_pause_waits_for_the_new_weights(llm, new_dir):
    """While paused, a new request queues even with the weights asleep or half written (as
    TRL's async rollout worker keeps posting across a weight sync); it runs after the resume,
    all of it with the new weights. Unpaused, the same request is refused."""
    engine = llm.engine
    engine.sleep(level=1)
    with pytest.raises(EngineSleepingError):
        add(engine, PROMPTS[:1])
    engine.pause_generation("keep")
    ids = add(engine, PROMPTS[:1])
    engine.wake_up(["weights"])
    engine.update_weights(load_file(str(new_dir / "model.safetensors")))
    engine.wake_up(["kv_cache"])
    assert engine.step() == []  # still paused
    engine.resume_generation()
    outputs = {}
    step_until(engine, lambda: len(outputs) == 1, outputs)
    completion = outputs[ids[0]].outputs[0]
    assert completion.token_ids == hf_greedy(str(new_dir), PROMPTS[0], MAX_TOKENS)
    assert completion.weight_versions == [WeightVersionSpan(1, 0, MAX_TOKENS)]


def test_keeping_the_cache_recomputes_nothing(llm):
    engine = llm.engine
    scheduled: list[int] = []
    schedule = engine.scheduler.schedule

    def counting_schedule():
        output = schedule()
        scheduled.append(output.total_num_scheduled_tokens)
        return output

    engine.scheduler.schedule = counting_schedule

    def switch() -> None:
        free_blocks = engine.scheduler.num_free_blocks
        engine.pause_generation("keep", clear_cache=False)
        assert engine.scheduler.num_free_blocks == free_blocks  # their KV stays
        scheduled.clear()
        engine.resume_generation()

    generate_across_a_switch(engine, switch)
    # After the resume every step decodes one token per request: no prompt is computed again.
    assert max(scheduled) <= len(PROMPTS) and engine.scheduler.num_preemptions == 0


def generate_with_switch(engine: LLMEngine, switch, params: SamplingParams) -> list[list[int]]:
    ids, outputs = add(engine, PROMPTS, params), {}
    step_until(engine, lambda: all(num_generated(engine, i) >= SWITCH_AT for i in ids), outputs)
    switch()
    step_until(engine, lambda: len(outputs) == len(ids), outputs)
    return [outputs[i].outputs[0].token_ids for i in ids]


def test_a_seeded_request_gives_the_same_tokens_with_the_switch_at_the_same_step(
    llama_dir, new_dir
):
    weights = load_file(str(new_dir / "model.safetensors"))
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = LLM(str(llama_dir), **ENGINE_OPTIONS).engine

        def switch(engine=engine) -> None:
            engine.pause_generation("keep")
            engine.update_weights(weights)
            engine.resume_generation()

        runs.append(generate_with_switch(engine, switch, seeded))
    assert runs[0] == runs[1]


def test_aborting_a_kept_request_frees_its_blocks(llm):
    engine = llm.engine
    ids, outputs = add(engine, PROMPTS), {}
    step_until(engine, lambda: num_generated(engine, ids[0]) >= 2, outputs)
    engine.pause_generation("keep", clear_cache=False)
    assert engine.scheduler.num_free_blocks < engine.scheduler.num_blocks
    engine.abort_request(ids)
    step_until(engine, lambda: len(outputs) == len(ids), outputs)  # their "abort" outputs
    assert {o.outputs[0].finish_reason for o in outputs.values()} == {"abort"}
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks
    assert not engine.has_unfinished_requests()


def test_a_fault_in_the_resumed_step_ends_its_prompts_and_the_engine_serves(llm, llama_dir):
    engine = llm.engine
    ids, outputs = add(engine, PROMPTS[:2]), {}
    step_until(engine, lambda: num_generated(engine, ids[0]) >= 2, outputs)
    engine.pause_generation("keep")  # their KV is recomputed at the resume: a prefill step
    engine.worker.model_runner.set_fault_injector(FaultInjector(when="prefill", error="oom"))
    engine.resume_generation()
    with pytest.raises(DeviceOutOfMemoryError):
        step_until(engine, lambda: False, outputs)
    engine.worker.model_runner.set_fault_injector(None)
    step_until(engine, lambda: not engine.has_unfinished_requests(), outputs)
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks
    out = llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0]
    assert out.token_ids == hf_greedy(str(llama_dir), PROMPTS[0], MAX_TOKENS)


def test_pause_modes_abort_and_wait_and_what_a_paused_engine_refuses(llm):
    engine = llm.engine
    add(engine, PROMPTS)
    engine.step()
    aborted = engine.pause_generation("abort")
    assert {o.outputs[0].finish_reason for o in aborted} == {"abort"} and engine.is_paused()
    with pytest.raises(EngineBusyError, match="resume_generation"):
        llm.generate([PROMPTS[0]], GREEDY)  # offline, nothing could resume it
    with pytest.raises(EngineBusyError, match="cannot drain"):
        llm.sleep(level=1, mode="wait")
    engine.resume_generation()
    ids = add(engine, PROMPTS[:2])
    engine.step()
    drained = llm.pause_generation("wait")
    assert [o.request_id for o in drained] == ids
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in drained)
    engine.resume_generation()
    assert llm.generate([PROMPTS[1]], GREEDY)[0].outputs[0].weight_versions == [
        WeightVersionSpan(0, 0, MAX_TOKENS)]


def test_the_engine_leaves_wait_to_the_loop_that_steps_it(llm):
    """LLMEngine ends or keeps requests; draining them ("wait") is LLM's (or the server's)."""
    engine = llm.engine
    ids = add(engine, PROMPTS[:1])
    for call in (lambda: engine.sleep(level=1, mode="wait"),
                 lambda: engine.pause_generation("wait")):
        with pytest.raises(InvalidRequestError, match="LLM.sleep / LLM.pause_generation"):
            call()
    assert not engine.is_paused() and engine.unfinished_request_ids == ids
    drained = llm.sleep(level=1, mode="wait")
    assert [o.request_id for o in drained] == ids and drained[0].finished


@pytest.mark.parametrize("clear_cache", [True, False])
def test_clear_cache_on_an_abort_or_wait_pause_resets_the_prefix_cache(llm, clear_cache):
    engine = llm.engine
    llm.generate([PROMPTS[2]], GREEDY)
    llm.pause_generation("wait", clear_cache=clear_cache)
    engine.resume_generation()
    hits_before = engine.stats()["num_prefix_hit_tokens"]
    llm.generate([PROMPTS[2]], GREEDY)
    hit = engine.stats()["num_prefix_hit_tokens"] > hits_before
    assert hit is not clear_cache
