"""The grouped experts kernel (`kernels/csrc/moe_experts_cpu.cpp`) against transformers' own
experts forward, its fixed summation order (a token's bits alone = in any batch, any thread
count), its refusals, and where `experts_forward` uses it."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from kernels import cpu_extension
from rollout_engine.worker.models.experts import (
    can_pack_experts,
    experts_forward,
    pack_experts,
)

pytestmark = pytest.mark.skipif(not cpu_extension.available(), reason="no compiled CPU kernel")

HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K = 48, 40, 8, 2  # widths not multiples of 16


def make_experts(dtype: torch.dtype, seed: int = 0) -> Qwen3MoeExperts:
    config = transformers.Qwen3MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K, experts_implementation="grouped_mm")
    experts = Qwen3MoeExperts(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.2)
    return experts.to(dtype)


def make_tokens(num_tokens: int, dtype: torch.dtype, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=generator)
    weights, index = torch.topk(torch.softmax(logits, -1), TOP_K)
    return hidden, index, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def run_kernel(experts, hidden, index, weights) -> torch.Tensor:
    packed = pack_experts(experts)
    return cpu_extension.moe_experts(hidden, index, weights, packed.gate_up, packed.down,
                                     packed.intermediate_size)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
@torch.inference_mode()
def test_equals_transformers_experts(dtype, tolerance, num_tokens):
    experts = make_experts(dtype)
    hidden, index, weights = make_tokens(num_tokens, dtype)
    expected = grouped_mm_experts_forward(experts, hidden, index, weights).float()
    got = run_kernel(experts, hidden, index, weights)
    assert got.dtype == dtype and got.shape == hidden.shape
    scale = expected.abs().max().item()
    assert (got.float() - expected).abs().max().item() <= tolerance * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_a_tokens_bits_do_not_depend_on_the_batch_or_threads(dtype):
    experts = make_experts(dtype)
    hidden, index, weights = make_tokens(200, dtype)
    batch = run_kernel(experts, hidden, index, weights)
    for t in (0, 57, 199):
        alone = run_kernel(experts, hidden[t:t + 1], index[t:t + 1], weights[t:t + 1])
        assert torch.equal(alone[0], batch[t]), t
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_kernel(experts, hidden, index, weights)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, batch)


@torch.inference_mode()
def test_no_tokens_and_bad_input():
    experts = make_experts(torch.float32)
    hidden, index, weights = make_tokens(4, torch.float32)
    assert run_kernel(experts, hidden[:0], index[:0], weights[:0]).shape == (0, HIDDEN)
    with pytest.raises(RuntimeError, match="expert id 8 outside"):
        run_kernel(experts, hidden, torch.full_like(index, NUM_EXPERTS), weights)
    packed = pack_experts(experts)
    with pytest.raises(RuntimeError, match="do not match hidden size"):
        cpu_extension.moe_experts(hidden, index, weights, packed.gate_up, packed.down,
                                  INTERMEDIATE + 16)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        cpu_extension.moe_experts(hidden.double(), index, weights, packed.gate_up, packed.down,
                                  INTERMEDIATE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_grouped_linear_alone(dtype):
    """`moe_grouped_linear`: rows sorted by expert (one expert without rows) times their
    expert's weight, bits equal to the whole kernel's gate|up; bad offsets refused."""
    experts = make_experts(dtype)
    packed = pack_experts(experts)
    counts = [3, 0, 5, 1, 2, 1, 4, 2]
    x = torch.randn(sum(counts), HIDDEN).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    got = cpu_extension.moe_grouped_linear(x, offsets, packed.gate_up, 2 * INTERMEDIATE)
    expert_of = torch.repeat_interleave(torch.arange(NUM_EXPERTS), torch.tensor(counts))
    expected = torch.einsum("sk,snk->sn", x.float(), experts.gate_up_proj[expert_of].float())
    tolerance = 2e-6 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    assert (got.float() - expected).abs().max() <= tolerance * expected.abs().max()
    with pytest.raises(RuntimeError, match="offsets must run from 0"):
        cpu_extension.moe_grouped_linear(x, offsets - 1, packed.gate_up, 2 * INTERMEDIATE)
    with pytest.raises(RuntimeError, match="must not decrease"):
        bad = offsets.clone()
        bad[1] = 5  # past expert 1's end, 3
        cpu_extension.moe_grouped_linear(x, bad, packed.gate_up, 2 * INTERMEDIATE)
    with pytest.raises(RuntimeError, match="packed by moe_pack"):
        cpu_extension.moe_grouped_linear(x, offsets, packed.gate_up, INTERMEDIATE)


@torch.inference_mode()
def test_experts_forward_falls_back_where_the_kernel_does_not_serve():
    experts = make_experts(torch.float32)
    hidden, index, weights = make_tokens(5, torch.float32)
    assert can_pack_experts(experts)
    expected = grouped_mm_experts_forward(experts, hidden, index, weights)
    # Not packed (a GPU, the batch-invariant mode, weights just updated): transformers' path.
    assert torch.equal(experts_forward(experts, hidden, index, weights), expected)
    experts.packed_experts = pack_experts(experts)
    assert torch.equal(experts_forward(experts, hidden, index, weights),
                       run_kernel(experts, hidden, index, weights))
    experts.act_fn = torch.nn.GELU()
    assert not can_pack_experts(experts)


@torch.inference_mode()
def test_bf16_rows_past_the_limit_go_to_grouped_mm_only_where_the_cpu_computes_bf16(
        bf16_arithmetic):
    """oneDNN's bf16 GEMMs beat the kernel past 48 rows per expert where they are native; where
    the CPU has no bf16 arithmetic they are emulated, and the kernel keeps every row count."""
    experts = make_experts(torch.bfloat16)
    experts.packed_experts = pack_experts(experts)
    hidden, index, weights = make_tokens(300, torch.bfloat16)  # 75 rows per expert on average
    got = experts_forward(experts, hidden, index, weights)
    kernel = run_kernel(experts, hidden, index, weights)
    transformers_path = grouped_mm_experts_forward(experts, hidden, index, weights)
    assert not torch.equal(kernel, transformers_path)  # the two paths are told apart
    assert torch.equal(got, transformers_path if bf16_arithmetic else kernel)
    few = slice(0, 7)  # under the limit: the kernel either way
    assert torch.equal(experts_forward(experts, hidden[few], index[few], weights[few]),
                       run_kernel(experts, hidden[few], index[few], weights[few]))
