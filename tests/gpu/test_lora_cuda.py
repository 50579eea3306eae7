"""LoRA on CUDA: the Triton kernels against the delta written in torch, and an engine serving a
batch that mixes three PEFT adapters and the base model against PEFT's own model (fp32, both
modeling backends), with the deltas through Triton; adapters on a MoE's experts (grouped
GEMMs)."""

from __future__ import annotations

import sys

import pytest
import torch

from rollout_engine import LLM
from tests.integration.test_lora import (  # noqa: F401 - fixtures
    GREEDY,
    adapters,
    check_against_peft,
    check_moe_adapters,
    oracles,
    prompts_and_loras,
)
from tests.unit.test_lora_kernel import reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_the_torch_delta(dtype):
    from kernels.triton_lora import lora_add_triton

    torch.manual_seed(0)
    num_tokens, in_features, out_features, max_rank, num_slots = 37, 896, [896, 128, 128], 16, 4
    x = torch.randn(num_tokens, in_features).to(dtype)
    a = torch.randn(num_slots, 3 * max_rank, in_features).to(dtype) / 16
    bt = [torch.randn(num_slots, max_rank, out).to(dtype) / 4 for out in out_features]
    packed = torch.randn(num_tokens, sum(out_features)).to(dtype)
    blocks = torch.tensor([[0, 1, 2], [-1, 0, -1], [1, -1, 0], [2, 0, 1]])
    ranks = torch.tensor([16, 5, 3, 1])
    groups = [(0, list(range(9))), (2, [9, 30, 12]), (1, list(range(13, 25))), (3, [31, 36])]
    row_slots = torch.full((num_tokens,), -1, dtype=torch.int32)
    for slot, rows in groups:
        row_slots[rows] = slot
    expected = reference(x, a, bt, list(packed.split(out_features, -1)), groups, blocks, ranks)
    on_device = packed.cuda()
    outs = list(on_device.split(out_features, -1))
    lora_add_triton(x.cuda(), a.cuda(), [b.cuda() for b in bt], outs, row_slots.cuda(),
                    blocks.to("cuda", torch.int32), ranks.to("cuda", torch.int32))
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (5e-2, 3e-2)
    for got, want in zip(outs, expected):
        torch.testing.assert_close(got.float().cpu(), want.to(dtype).float(), atol=atol, rtol=rtol)
    base = (row_slots < 0).nonzero().flatten()
    assert torch.equal(on_device.cpu()[base], packed[base])


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
def test_mixed_batch_on_cuda_matches_peft(llama_dir, adapters, oracles, model_impl):  # noqa: F811
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=16, model_impl=model_impl, kv_cache_bytes=64 << 20)
    try:
        prompts, loras = prompts_and_loras(adapters)
        outputs = llm.generate(prompts, GREEDY, lora_request=loras)
    finally:
        llm.shutdown()
    assert "kernels.triton_lora" in sys.modules, "CUDA LoRA deltas should run through Triton"
    check_against_peft(outputs, prompts, loras, oracles)


def test_moe_expert_adapters_on_cuda_match_peft(tmp_path):
    check_moe_adapters(tmp_path, device="cuda", dtype="float32", kv_cache_bytes=64 << 20)
