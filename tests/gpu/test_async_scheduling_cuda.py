"""Async scheduling on a GPU: the forward thread launches on the engine's device, placeholder
tokens are filled on the device from the previous step, and the tokens match the synchronous
loop (greedy and seeded), with CUDA graphs too."""

from __future__ import annotations

import pytest

from rollout_engine import LLM, SamplingParams
from tests.integration.test_async_scheduling import completions, make_prompts

pytestmark = pytest.mark.gpu

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(n=4, temperature=1.0, top_p=0.9, max_tokens=24, seed=3,
                   stop_token_ids=[7, 11, 13]),
]


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_async_matches_sync_on_cuda(llama_dir, cuda_graphs: bool) -> None:
    prompts = make_prompts(num_prompts=8)
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(llama_dir), device="cuda", dtype="float32", block_size=16,
                  async_scheduling=async_scheduling, cuda_graphs=cuda_graphs)
        try:
            results.append([completions(llm.generate(prompts, p)) for p in PARAMS])
            stats = llm.stats()
            assert stats["num_free_blocks"] == stats["num_blocks"]
        finally:
            llm.engine.shutdown()
    assert results[1] == results[0]
