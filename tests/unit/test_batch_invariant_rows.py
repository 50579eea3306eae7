"""The batch-invariant row ops on the CPU: the mode's `mean` over the last dimension and
`F.silu` (the trainer's side), and the engine's fused RMSNorm and SiLU-and-mul in their
invariant form, which must give what Hugging Face's torch ops give in the mode, bit for bit,
for any width (off the 16-lane groups and not a power of two too); a row's bits do not depend on
the rows around it or the thread count; the routed ops keep torch's gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kernels import cpu_extension
from rollout_engine.batch_invariant import set_batch_invariant_mode
from tests.unit.test_paged_attention_cpu import require_kernel

DTYPES = [torch.float32, torch.bfloat16]
WIDTHS = [96, 200, 896]  # 896 = Qwen2-0.5B's hidden size


@pytest.fixture(autouse=True)
def kernel() -> None:
    require_kernel()


def rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * 3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_the_fused_norms_are_hugging_faces_under_the_mode(dtype, width):
    norm = LlamaRMSNorm(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, residual = rows((33, width), dtype), rows((33, width), dtype, seed=1)
    with torch.inference_mode(), set_batch_invariant_mode():
        expected = norm(x)
        expected_residual = x + residual
        expected_after_add = norm(expected_residual)
    assert torch.equal(cpu_extension.rms_norm(x, norm.weight, 1e-6, invariant=True), expected)
    x_in, residual_in = x.clone(), residual.clone()
    cpu_extension.add_rms_norm(x_in, residual_in, norm.weight, 1e-6, invariant=True)
    assert torch.equal(residual_in, expected_residual)
    assert torch.equal(x_in, expected_after_add)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [48, 37, 1408])
def test_the_fused_silu_and_mul_is_hugging_faces_under_the_mode(dtype, width):
    gate_up = rows((29, 2 * width), dtype)
    gate, up = gate_up.split(width, -1)
    with torch.inference_mode(), set_batch_invariant_mode():
        expected = F.silu(gate) * up
    assert torch.equal(cpu_extension.silu_and_mul(gate_up, invariant=True), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_mean_and_silu_keep_their_bits_anywhere_and_stay_close_to_torch(dtype):
    x = rows((64, 200), dtype)
    mean, silu = cpu_extension.invariant_mean(x), cpu_extension.invariant_silu(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for i in (0, 17, 63):
            assert torch.equal(cpu_extension.invariant_mean(x[i:i + 1]), mean[i:i + 1])
    finally:
        torch.set_num_threads(threads)
    # An element's silu is the same in a vector's lanes and in a last partial group.
    flat = x.reshape(-1)
    for offset in (1, 5, 15):
        assert torch.equal(cpu_extension.invariant_silu(flat[offset:offset + 21]),
                           silu.reshape(-1)[offset:offset + 21])
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(mean, x.float().mean(-1).to(dtype), **tolerance)
    torch.testing.assert_close(silu, F.silu(x.float()).to(dtype), **tolerance)


def test_the_mode_routes_mean_and_silu_with_torchs_gradients():
    x = rows((4, 6, 40), torch.float32).requires_grad_()
    with set_batch_invariant_mode():
        mean = x.pow(2).mean(-1, keepdim=True)
        mean_of_rows = torch.mean(x, dim=(-1,))
        silu = F.silu(x)
        whole = x.mean()  # not over the last dimension only: torch's own
    assert torch.equal(mean[..., 0], cpu_extension.invariant_mean(x.detach().pow(2)))
    assert torch.equal(mean_of_rows, cpu_extension.invariant_mean(x.detach()))
    assert torch.equal(silu, cpu_extension.invariant_silu(x.detach()))
    assert torch.equal(whole, x.detach().mean())
    got = torch.autograd.grad((mean.sum() + mean_of_rows.sum() + silu.sum()), x)[0]
    reference = x.detach().clone().requires_grad_()
    expected = torch.autograd.grad(reference.pow(2).mean(-1).sum() + reference.mean(-1).sum()
                                   + F.silu(reference).sum(), reference)[0]
    torch.testing.assert_close(got, expected)


def test_an_in_place_silu_under_the_mode_writes_the_invariant_values():
    x = rows((3, 50), torch.bfloat16)
    expected = cpu_extension.invariant_silu(x)
    with torch.inference_mode(), set_batch_invariant_mode():
        out = F.silu(x, inplace=True)
    assert out is x and torch.equal(x, expected)


def test_the_invariant_ops_refuse_float64():
    with pytest.raises(RuntimeError, match="float32, bfloat16 and float16"):
        cpu_extension.invariant_mean(torch.ones(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="float32, bfloat16 and float16"):
        cpu_extension.rms_norm(torch.ones(2, 8, dtype=torch.float64),
                               torch.ones(8, dtype=torch.float64), 1e-6, invariant=True)
