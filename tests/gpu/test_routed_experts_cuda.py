"""Routed experts on CUDA: a Qwen3-MoE through the transformers backend on the GPU returns the
experts the CPU engine returns (fp32), prompt and output, with the prefix cache on."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_engine import LLM
from tests.integration.test_routed_experts import PARAMS, PROMPTS, moe_dir, routing_of  # noqa: F401

pytestmark = pytest.mark.gpu


def test_cuda_routing_equals_the_cpu_engines(moe_dir):  # noqa: F811
    on_cpu = LLM(str(moe_dir), enable_return_routed_experts=True).generate(PROMPTS, PARAMS)
    llm = LLM(str(moe_dir), device="cuda", dtype="float32", enable_return_routed_experts=True,
              kv_cache_bytes=64 << 20, block_size=4)
    try:
        llm.generate(PROMPTS, PARAMS)
        on_cuda = llm.generate(PROMPTS, PARAMS)  # the prompts from the prefix cache
    finally:
        llm.shutdown()
    for cpu, cuda in zip(on_cpu, on_cuda):
        assert cuda.outputs[0].token_ids == cpu.outputs[0].token_ids
        assert np.array_equal(routing_of(cuda), routing_of(cpu))
