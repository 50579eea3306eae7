"""The Triton fused-MoE kernels (`kernels/triton_moe.py`) under TRITON_INTERPRET=1 on CPU
tensors, against transformers' own experts forward: decode- and prefill-sized blocks, experts
no token chose, and the block layout the two launches share."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.moe import grouped_mm_experts_forward

from tests.unit.test_kernels_triton import pytestmark, triton_kernels  # noqa: F401
from tests.unit.test_moe_experts_cpu import NUM_EXPERTS, make_experts, make_tokens


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_tokens", [1, 13, 150])  # 150 x 2 pairs: 64-row blocks
@torch.inference_mode()
def test_equals_transformers_experts(triton_kernels, dtype, tolerance,  # noqa: F811
                                     num_tokens):
    experts = make_experts(dtype)
    hidden, index, weights = make_tokens(num_tokens, dtype)
    expected = grouped_mm_experts_forward(experts, hidden, index, weights).float()
    got = triton_kernels.moe.fused_moe_triton(hidden, index, weights, experts.gate_up_proj,
                                              experts.down_proj)
    assert got.dtype == dtype and got.shape == hidden.shape
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, atol=tolerance * scale, rtol=0)


@torch.inference_mode()
def test_experts_no_token_chose(triton_kernels):  # noqa: F811
    experts = make_experts(torch.float32)
    hidden, index, weights = make_tokens(9, torch.float32)
    index = torch.where(index % 2 == 0, 0, 5)  # experts 0 and 5 only, some tokens twice
    expected = grouped_mm_experts_forward(experts, hidden, index, weights)
    got = triton_kernels.moe.fused_moe_triton(hidden, index, weights, experts.gate_up_proj,
                                              experts.down_proj)
    torch.testing.assert_close(got, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


def test_blocks_hold_every_pair_once_under_its_expert(triton_kernels):  # noqa: F811
    _, index, _ = make_tokens(37, torch.float32)
    block_m = 16
    pair_ids, block_experts = triton_kernels.moe._align_to_blocks(index, NUM_EXPERTS, block_m)
    assert block_experts.numel() == -(-index.numel() // block_m) + NUM_EXPERTS
    real = pair_ids[pair_ids >= 0].long()
    assert sorted(real.tolist()) == list(range(index.numel()))
    experts_of_slots = block_experts.long().repeat_interleave(block_m)
    assert torch.equal(experts_of_slots[pair_ids >= 0], index.flatten()[real])
    used = block_experts[block_experts >= 0]
    assert torch.equal(used, used.sort().values)  # one run per expert, in order
    assert (block_experts[used.numel():] == -1).all()


def test_refuses_weights_of_another_width(triton_kernels):  # noqa: F811
    experts = make_experts(torch.float32)
    hidden, index, weights = make_tokens(3, torch.float32)
    with pytest.raises(ValueError, match="do not fit hidden size"):
        triton_kernels.moe.fused_moe_triton(hidden[:, :-1], index, weights,
                                            experts.gate_up_proj, experts.down_proj)
