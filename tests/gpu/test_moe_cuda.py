"""The Triton fused MoE (`kernels/triton_moe.py`) compiled on a GPU, against transformers' own
experts forward at a Qwen3-30B-A3B-like width (128 experts, 8 per token), decode and prefill
sized; and the transformers backend's experts dispatch sends CUDA tensors to it."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from rollout_engine.worker.models import experts as our_experts

pytestmark = pytest.mark.gpu


def make_cuda_experts(dtype: torch.dtype) -> Qwen3MoeExperts:
    config = transformers.Qwen3MoeConfig(hidden_size=1024, moe_intermediate_size=384,
                                         num_experts=128, num_experts_per_tok=8)
    module = Qwen3MoeExperts(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in (module.gate_up_proj, module.down_proj):
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.05)
    return module.to("cuda", dtype)


def make_cuda_tokens(num_tokens: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(num_tokens, 1024, generator=generator)
    logits = torch.randn(num_tokens, 128, generator=generator)
    weights, index = torch.topk(torch.softmax(logits, -1), 8)
    weights = weights / weights.sum(-1, keepdim=True)
    return hidden.to("cuda", dtype), index.cuda(), weights.to("cuda", dtype)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
@torch.inference_mode()
def test_fused_moe_equals_transformers_on_cuda(dtype, tolerance, num_tokens):
    from kernels.triton_moe import fused_moe_triton

    module = make_cuda_experts(dtype)
    hidden, index, weights = make_cuda_tokens(num_tokens, dtype)
    expected = grouped_mm_experts_forward(module, hidden, index, weights).float()
    got = fused_moe_triton(hidden, index, weights, module.gate_up_proj, module.down_proj)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, atol=tolerance * scale, rtol=0)
    # the dispatch of the transformers backend runs the same kernel on CUDA tensors
    assert torch.equal(our_experts.experts_forward(module, hidden, index, weights), got)
