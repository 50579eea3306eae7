"""Greedy outputs and logprobs of our engine against the Hugging Face model (the oracle)."""

from __future__ import annotations

import random

import pytest
import torch

from rollout_engine import LLM, SamplingParams
from tests.conftest import ARCHS
from tests.integration.hf_oracle import hf_greedy, hf_greedy_batch, hf_logprobs

MAX_NEW_TOKENS = 24


def make_prompts(num_prompts: int = 16, seed: int = 0, vocab: int = 500) -> list[list[int]]:
    """Mixed lengths (3..60), half of them sharing one of two 20-token prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(20)] for _ in range(2)]
    prompts = []
    for i in range(num_prompts):
        suffix = [rng.randrange(vocab) for _ in range(rng.randint(3, 40))]
        prompts.append(prefixes[i % 2] + suffix if i % 2 == 0 or i % 4 == 1 else suffix)
    return prompts


PROMPTS = make_prompts()

SETTINGS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_blocks": 32, "block_size": 4, "enable_prefix_caching": False},
    "prefix_caching": {"enable_prefix_caching": True, "block_size": 4},
}


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dirs) -> dict[str, list[list[int]]]:
    return {
        arch: hf_greedy_batch(str(tiny_model_dirs[arch]), PROMPTS, MAX_NEW_TOKENS)
        for arch in ARCHS
    }


def test_batched_oracle_matches_per_prompt_generate(tiny_model_dirs, hf_reference):
    # The left-padded reference equals unpadded per-prompt `generate` (spot check).
    for i in (0, 5):
        expected = hf_greedy(str(tiny_model_dirs["llama"]), PROMPTS[i], MAX_NEW_TOKENS)
        assert hf_reference["llama"][i] == expected


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_model_dirs, hf_reference, arch, setting):
    llm = LLM(str(tiny_model_dirs[arch]), **SETTINGS[setting])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for prompt, output, expected in zip(PROMPTS, outputs, hf_reference[arch]):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == expected, f"prompt {prompt}"
        assert output.outputs[0].finish_reason == "length"
    scheduler = llm.engine.scheduler
    if setting == "preemption":
        assert scheduler.num_preemptions > 0, "the small KV pool should force preemption"
    if setting == "prefix_caching":
        assert scheduler.num_prefix_hit_tokens > 0, "shared prefixes should hit the cache"
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.5])
def test_logprobs_match_transformers(llama_dir, temperature):
    llm = LLM(str(llama_dir))
    params = SamplingParams(temperature=temperature, max_tokens=12, seed=3, ignore_eos=True)
    for prompt, output in zip(PROMPTS[:4], llm.generate(PROMPTS[:4], params)):
        completion = output.outputs[0]
        expected = hf_logprobs(str(llama_dir), prompt, completion.token_ids, temperature or 1.0)
        got = torch.tensor(completion.logprobs)
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def test_seeded_sampling_is_reproducible_and_samples_differ(llama_dir):
    llm = LLM(str(llama_dir))
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    first = llm.generate(PROMPTS[:3], params)
    second = llm.generate(PROMPTS[:3], params)
    for a, b in zip(first, second):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        samples = {tuple(o.token_ids) for o in a.outputs}
        assert len(samples) == 4, "the n samples of one prompt should differ"
    other_seed = llm.generate(PROMPTS[:3], SamplingParams(**{**params.__dict__, "seed": 8}))
    assert [o.token_ids for o in other_seed[0].outputs] != [o.token_ids for o in first[0].outputs]


def test_group_prefilled_once(llama_dir):
    llm = LLM(str(llama_dir), block_size=4)
    prompt = PROMPTS[0]
    params = SamplingParams(n=8, temperature=1.0, max_tokens=4, seed=0)
    llm.generate([prompt], params)
    full_blocks = (len(prompt) - 1) // 4
    # Every sibling after the first reuses the prompt's full blocks.
    assert llm.engine.scheduler.num_prefix_hit_tokens == 7 * full_blocks * 4


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    from rollout_engine.tiny_model import LLAMA3_ROPE_SCALING, build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "llama3", "llama", rope_scaling=LLAMA3_ROPE_SCALING))
    expected = hf_greedy_batch(model_dir, PROMPTS[:6], MAX_NEW_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = LLM(model_dir).generate(PROMPTS[:6], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_qwen2_with_attention_bias_has_no_o_proj_bias(tmp_path):
    # Qwen2's q/k/v always carry a bias and its o_proj never does, whatever attention_bias says.
    from rollout_engine.tiny_model import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "qwen2-bias", "qwen2", attention_bias=True))
    llm = LLM(model_dir)
    o_proj = llm.engine.worker.model_runner.model.model.layers[0].self_attn.o_proj
    assert o_proj.bias is None
    expected = hf_greedy_batch(model_dir, PROMPTS[:4], MAX_NEW_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params)] == expected
