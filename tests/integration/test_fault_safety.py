"""A step whose forward raises (a CUDA OOM, Ctrl-C) leaves nothing behind that a later request
could read: retries match the Hugging Face oracle, sleep and weight updates still work, and no
KV block leaks."""

from __future__ import annotations

import random

import pytest
from safetensors.torch import load_file

from rollout_engine import LLM, DeviceOutOfMemoryError, SamplingParams, StepFailedError
from rollout_engine.worker.fault_injection import FaultInjector
from tests.integration.hf_oracle import hf_greedy_batch

MAX_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
# A 16-token budget chunks the 22..30-token prompts; 4-token blocks give many cached blocks.
ENGINE_OPTIONS = {
    "block_size": 4, "max_num_batched_tokens": 16, "num_speculative_tokens": 3,
    "max_model_len": 256,
}
FAULTS = {"oom": DeviceOutOfMemoryError, "interrupt": KeyboardInterrupt,
          "runtime": StepFailedError}


def make_prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Repetitive prompts (so drafting kicks in), and prompts sharing their first 16 tokens."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(3):
        span = [rng.randrange(3, 500) for _ in range(8)]
        prompts.append(span + [rng.randrange(3, 500) for _ in range(rng.randint(6, 14))] + span)
    sharing = [p[:16] + [rng.randrange(3, 500) for _ in range(5)] for p in prompts]
    return prompts, sharing


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(llama_dir, request):
    """Both step loops: under async scheduling a failed step also ends the step launched
    after it, and drafting is off (spec_decode faults then hit no step: see below)."""
    engine = LLM(str(llama_dir), async_scheduling=request.param, **ENGINE_OPTIONS)
    yield engine
    engine.engine.shutdown()


def inject(llm: LLM, **fault) -> FaultInjector:
    injector = FaultInjector(**fault)
    llm.engine.worker.model_runner.set_fault_injector(injector)
    return injector


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("error", ["oom", "interrupt"])
@pytest.mark.parametrize("when", ["prefill", "chunked_prefill", "spec_decode"])
def test_a_failed_step_leaves_no_trace(llm, llama_dir, when, error):
    if when == "spec_decode" and llm.engine.async_scheduling:
        when = "decode"  # no drafts under async scheduling: fail a plain decode step
    prompts, sharing = make_prompts(seed=len(when) * 10 + len(error))
    oracle = hf_greedy_batch(str(llama_dir), prompts + sharing, MAX_NEW_TOKENS)
    injector = inject(llm, when=when, error=error)
    try:
        with pytest.raises(FAULTS[error]) as failure:
            llm.generate(prompts, GREEDY)
    finally:
        llm.engine.worker.model_runner.set_fault_injector(None)
    assert injector.num_raised == 1
    assert failure.value.request_ids, "the error names the prompts it ended"
    # generate() aborted its own requests; every block is free again.
    assert not llm.engine.has_unfinished_requests()
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    # A retry, and prompts sharing the prefix, read no half-written KV from the prefix cache.
    assert greedy_tokens(llm, prompts + sharing) == oracle
    # sleep(mode="wait") drains and returns; a full weight update is accepted.
    llm.engine.add_request("drained", prompts[0], GREEDY)
    drained = llm.sleep(level=2, mode="wait")
    assert [o.outputs[0].token_ids for o in drained] == [oracle[0]]
    llm.wake_up()
    version = llm.update_weights(load_file(str(llama_dir / "model.safetensors")))
    assert version == llm.weight_version >= 1
    assert greedy_tokens(llm, sharing) == oracle[len(prompts):]
    assert llm.stats()["num_free_blocks"] == stats["num_blocks"]


def test_only_the_failed_steps_prompts_end(llama_dir):
    """A prompt still waiting when a step fails is not touched by the failure."""
    prompts, _ = make_prompts(seed=7)
    oracle = hf_greedy_batch(str(llama_dir), prompts, MAX_NEW_TOKENS)
    llm = LLM(str(llama_dir), block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    inject(llm, when="prefill", error="runtime")
    engine.add_request("first", prompts[0], GREEDY)  # 22+ tokens: the whole 16-token budget
    engine.add_request("second", prompts[1], GREEDY)
    with pytest.raises(StepFailedError, match="injected fault") as failure:
        engine.step()
    assert failure.value.request_ids == ["first"]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outputs["first"].outputs[0].finish_reason == "abort"
    assert outputs["second"].outputs[0].token_ids == oracle[1]


def test_released_memory_freezes_requests_until_wake(llm, llama_dir):
    """KV memory released behind the engine's back: the engine sees the worker is not ready,
    schedules nothing (no step reads released memory), and the request goes on after wake."""
    prompts, _ = make_prompts(seed=3)
    oracle = hf_greedy_batch(str(llama_dir), prompts[:1], MAX_NEW_TOKENS)
    llm.engine.add_request("late", prompts[0], GREEDY)
    llm.engine.worker.release_kv_cache()  # behind the engine's back: only the worker knows
    try:
        assert llm.engine.is_frozen and not llm.engine.can_make_progress()
        assert llm.engine.step() == [] and llm.engine.unfinished_request_ids == ["late"]
    finally:
        llm.wake_up(["kv_cache"])
        llm.reset_prefix_cache()
    outputs = {}
    while llm.engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in llm.engine.step() if o.finished)
    assert outputs["late"].outputs[0].token_ids == oracle[0]
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_a_step_run_on_released_memory_anyway_ends_its_prompts(llm, monkeypatch):
    """Were a step to run on released KV memory anyway (the engine's gate fooled), the
    worker's own check refuses it: its prompts end with a typed error naming kv_cache."""
    prompts, _ = make_prompts(seed=4)
    llm.engine.add_request("late", prompts[0], GREEDY)
    llm.engine.worker.release_kv_cache()
    worker_type = type(llm.engine.worker)
    monkeypatch.setattr(worker_type, "is_ready", property(lambda self: True))  # the gate only
    try:
        with pytest.raises(Exception, match="kv_cache") as failure:
            for _ in range(3):  # under async scheduling the first step only launches
                llm.engine.step()
        assert failure.value.request_ids == ["late"]
    finally:
        monkeypatch.undo()
        llm.wake_up(["kv_cache"])
        llm.reset_prefix_cache()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
