"""The engine end to end on CUDA (Triton attention) against the CPU engine (torch reference)."""

from __future__ import annotations

import sys

import pytest
import torch

import kernels.dispatch
from rollout_engine import LLM, SamplingParams
from tests.conftest import ARCHS
from tests.integration.test_parity import PROMPTS

pytestmark = pytest.mark.gpu

MAX_NEW_TOKENS = 24
KV_CACHE_BYTES = 64 << 20
SETTINGS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "prefix_caching": {"enable_prefix_caching": True, "block_size": 4},
}


def greedy(model_dir, device: str, options: dict):
    # The default KV sizing (gpu_memory_utilization of the device) is what runs here.
    llm = LLM(str(model_dir), device=device, dtype="float32", **options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    try:
        return [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    finally:
        llm.shutdown()  # half of the GPU's memory each: freed before the next engine


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_engine_matches_cpu_engine(tiny_model_dirs, arch, setting):
    on_cpu = greedy(tiny_model_dirs[arch], "cpu", SETTINGS[setting])
    on_cuda = greedy(tiny_model_dirs[arch], "cuda", SETTINGS[setting])
    assert "kernels.triton_paged_attention" in sys.modules, "CUDA attention should use Triton"
    for prompt, cpu_out, cuda_out in zip(PROMPTS, on_cpu, on_cuda):
        assert cuda_out.token_ids == cpu_out.token_ids, f"prompt {prompt}"
        diff = (torch.tensor(cuda_out.logprobs) - torch.tensor(cpu_out.logprobs)).abs().max()
        assert diff <= 1e-3, f"logprobs differ by {diff}"


def test_cuda_bfloat16_triton_attention_agrees_with_reference_attention(llama_dir, monkeypatch):
    # Same device, same dtype, only the attention differs; bf16 rounding may flip a
    # near-tie, so ask for agreement on the first token of nearly every prompt.
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    def generate() -> list:
        llm = LLM(str(llama_dir), device="cuda", dtype="bfloat16", kv_cache_bytes=KV_CACHE_BYTES)
        try:
            return llm.generate(PROMPTS, params)
        finally:
            llm.shutdown()

    with_triton = generate()
    monkeypatch.setattr(kernels.dispatch, "_use_triton", lambda t: False)
    with_ref = generate()
    pairs = [(a.outputs[0], b.outputs[0]) for a, b in zip(with_triton, with_ref)]
    agree = [(a, b) for a, b in pairs if a.token_ids[0] == b.token_ids[0]]
    assert len(agree) >= len(PROMPTS) - 1, f"{len(agree)}/{len(PROMPTS)} first tokens agree"
    worst = max(abs(a.logprobs[0] - b.logprobs[0]) for a, b in agree)
    assert worst <= 0.05, f"first-token logprobs differ by {worst}"
