"""Async scheduling gives the tokens the synchronous loop gives, on a real model.

Step N+1 is scheduled and its inputs built while step N computes (on the CPU the forward
runs on the caller's thread, the scheduling on the engine's host thread); its placeholder
inputs are filled on the device from step N's sampled tokens. A seeded request's
tokens depend on its seed, prompt and parameters only, so every scenario must match the
synchronous engine token for token (logprobs within float noise: a preemption recomputes a
prompt at a different moment in each loop).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from safetensors.torch import load_file

from rollout_engine import LLM, SamplingParams
from tests.integration.hf_oracle import hf_greedy_batch

SHARED = {"block_size": 4, "max_num_batched_tokens": 32, "max_model_len": 128}
# Name -> (engine options, sampling parameters).
SCENARIOS = {
    "greedy": ({}, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)),
    "sampled-groups": (
        {}, SamplingParams(n=4, temperature=1.0, top_p=0.9, top_k=50, max_tokens=20, seed=11,
                           ignore_eos=True),
    ),
    # EOS and a stop token end completions at different steps; max_tokens ends the rest.
    "stops": ({}, SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=5,
                                 stop_token_ids=[7, 11, 13, 17, 19, 23])),
    "repetition-penalty": (
        {}, SamplingParams(n=2, temperature=0.7, repetition_penalty=1.3, max_tokens=12, seed=2,
                           ignore_eos=True),
    ),
    # 24 blocks of 4 tokens for 6 prompts x 2 samples growing to 60 tokens: preemption.
    "tiny-pool": ({"num_blocks": 24}, SamplingParams(n=2, temperature=1.0, max_tokens=30,
                                                     seed=3, ignore_eos=True)),
    # The synchronous engine drafts; the async one does not. Same tokens either way.
    "speculation": ({"num_speculative_tokens": 3},
                    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
}


def make_prompts(seed: int = 0, num_prompts: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        span = [rng.randrange(3, 500) for _ in range(6)]  # repeats, so drafting has matches
        prompts.append(span + [rng.randrange(3, 500) for _ in range(rng.randint(4, 24))] + span)
    return prompts


def completions(outputs) -> list[list[tuple[list[int], str]]]:
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


def logprobs(outputs) -> list[float]:
    return [lp for o in outputs for c in o.outputs for lp in c.logprobs]


def run(llama_dir, async_scheduling: bool, options: dict, params: SamplingParams, prompts):
    llm = LLM(str(llama_dir), async_scheduling=async_scheduling, **SHARED, **options)
    try:
        outputs = llm.generate(prompts, params)
        stats = llm.stats()
    finally:
        llm.engine.shutdown()
    assert stats["num_free_blocks"] == stats["num_blocks"], "leaked KV blocks"
    return outputs, stats


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_async_scheduling_gives_the_synchronous_tokens(llama_dir, name):
    options, params = SCENARIOS[name]
    prompts = make_prompts()
    sync, sync_stats = run(llama_dir, False, options, params, prompts)
    async_, async_stats = run(llama_dir, True, options, params, prompts)
    assert completions(async_) == completions(sync)
    assert logprobs(async_) == pytest.approx(logprobs(sync), abs=1e-4)
    reasons = {c.finish_reason for o in sync for c in o.outputs}
    if name == "stops":
        assert reasons == {"stop", "length"}, "the scenario must end completions both ways"
    if name == "tiny-pool":
        assert sync_stats["num_preemptions"] > 0 and async_stats["num_preemptions"] > 0
    if name == "speculation":
        assert sync_stats["spec_num_accepted_tokens"] > 0 and "spec_num_drafts" not in async_stats
    if name == "greedy":
        expected = hf_greedy_batch(str(llama_dir), prompts, params.max_tokens)
        assert [o.outputs[0].token_ids for o in async_] == expected


def test_an_abort_while_steps_are_in_flight(llama_dir):
    """Aborted mid-flight: the prompt ends with "abort", the others are untouched, no block
    leaks, and no token reaches the aborted prompt after its abort."""
    prompts = make_prompts(seed=1, num_prompts=3)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=4, ignore_eos=True)
    reference = {
        f"p{i}": o for i, o in enumerate(LLM(str(llama_dir), **SHARED).generate(prompts, params))
    }
    llm = LLM(str(llama_dir), async_scheduling=True, **SHARED)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    finals, num_tokens_at_abort = {}, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        in_flight = engine.num_steps_in_flight
        if num_tokens_at_abort is None and engine.scheduler.requests["p1/0"].num_output_tokens >= 3:
            assert in_flight == 1, "a step is in flight after every step() of a run"
            num_tokens_at_abort = [len(r.output_token_ids) for r in
                                   (engine.scheduler.requests[f"p1/{j}"] for j in range(2))]
            engine.abort_request("p1")
    llm.engine.shutdown()
    aborted = finals["p1"].outputs
    assert [c.finish_reason for c in aborted] == ["abort", "abort"]
    assert [len(c.token_ids) for c in aborted] == num_tokens_at_abort
    for j, completion in enumerate(aborted):  # a prefix of what it would have generated
        assert completion.token_ids == reference["p1"].outputs[j].token_ids[: len(completion.token_ids)]
    for request_id in ("p0", "p2"):
        assert completions([finals[request_id]]) == completions([reference[request_id]])
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert engine.scheduler.num_finished_in_flight == 0


def test_sleep_wake_and_update_with_a_step_in_flight(llama_dir):
    """Memory changes only once the step in flight has landed; generation then goes on."""
    prompts = make_prompts(seed=2, num_prompts=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = hf_greedy_batch(str(llama_dir), prompts, greedy.max_tokens)
    llm = LLM(str(llama_dir), async_scheduling=True, **SHARED)
    try:
        llm.engine.add_request("cut", prompts[0], greedy)
        llm.engine.step()
        llm.engine.step()
        assert llm.engine.num_steps_in_flight, "a step is in flight"
        (aborted,) = llm.sleep(level=2)
        assert aborted.outputs[0].finish_reason == "abort" and not llm.engine.num_steps_in_flight
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
        llm.wake_up(["weights"])
        llm.update_weights(load_file(str(llama_dir / "model.safetensors")))
        llm.wake_up(["kv_cache"])
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == expected
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_forward_runs_on_the_callers_thread_with_the_engines_thread_count(
    llama_dir, async_scheduling
):
    """On the CPU the forward runs on the caller's thread in both loops, with `cpu_threads`,
    and the caller's own count is put back: a thread of the engine's own would give OpenMP a
    second pool of workers on the same cores (see LLMEngine). Async scheduling schedules the
    next step on its `engine-host` thread meanwhile, with one OpenMP thread."""
    before = torch.get_num_threads()
    llm = LLM(str(llama_dir), cpu_threads=1, async_scheduling=async_scheduling)
    seen, scheduled_on = [], []
    llm.engine.worker.model_runner.model.register_forward_pre_hook(
        lambda *_: seen.append((torch.get_num_threads(), threading.current_thread()))
    )
    schedule = llm.engine.scheduler.schedule

    def recording_schedule():
        scheduled_on.append((threading.current_thread().name, torch.get_num_threads()))
        return schedule()

    llm.engine.scheduler.schedule = recording_schedule
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
    llm.engine.shutdown()
    assert seen and {count for count, _ in seen} == {1}
    assert {thread for _, thread in seen} == {threading.current_thread()}
    assert torch.get_num_threads() == before
    caller = threading.current_thread().name
    if async_scheduling:  # the first step has no forward to overlap: the caller schedules it
        assert scheduled_on[0][0] == caller
        assert {name.split("_")[0] for name, _ in scheduled_on[1:]} == {"engine-host"}
        assert {count for _, count in scheduled_on[1:]} == {1}
    else:
        assert {name for name, _ in scheduled_on} == {caller}
