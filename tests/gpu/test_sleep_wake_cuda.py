"""Sleep and wake on CUDA free device memory (the driver's count, not the engine's) and keep
every address the model and KV cache use, so outputs are unchanged after waking."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rollout_engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

MiB = 1 << 20
PROMPTS = [[3, 14, 15, 92, 65], [2, 71, 82, 81, 82, 84]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_sleep_frees_device_memory_and_wake_keeps_addresses(llama_dir):
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", kv_cache_bytes=512 * MiB)
    expected = tokens(llm)
    kv_ptr, weight_ptrs = llm.kv_cache_ptr(), llm.weight_ptrs()
    pools = llm.memory_state().pool_bytes
    both = pools["weights"] + pools["kv_cache"]

    for level in (1, 2):
        before = free_bytes()
        llm.sleep(level=level)
        assert free_bytes() - before >= 0.95 * both, f"level {level} freed too little"
        llm.wake_up(["weights"])
        if level == 2:
            weights = load_file(str(llama_dir / "model.safetensors"), device="cuda")
            llm.update_weights(weights)
        llm.wake_up(["kv_cache"])
        assert llm.kv_cache_ptr() == kv_ptr and llm.weight_ptrs() == weight_ptrs
        assert tokens(llm) == expected

    before = free_bytes()
    llm.release_kv_cache_memory()
    assert free_bytes() - before >= 0.95 * pools["kv_cache"]
    llm.wake_up(["kv_cache"])
    assert tokens(llm) == expected
