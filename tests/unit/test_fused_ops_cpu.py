"""The compiled fused CPU ops (`kernels/csrc/fused_ops_cpu.cpp`) against the torch ops they
replace: in bfloat16 and float16 the same bits wherever Hugging Face's ops round (RMSNorm's sum
of squares is the one reduction, and its order may differ: bits equal in practice, checked within
one ulp), in float32 within float32's rounding; the KV store writes exactly the reference's
slots and refuses slots outside the cache before writing any."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_extension
from kernels.paged_attention_ref import store_kv_cache_ref
from rollout_engine.worker.models.layers import Rope, RotaryEmbedding, _rotate_half

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WIDTHS = [40, 512]
"""A width with a tail past the last full vector of 16 lanes, and one without."""


@pytest.fixture(autouse=True)
def kernel() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the engine uses the torch path")
    assert cpu_extension.available(), "the CPU kernels failed to build (see the log)"


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = x.to(torch.float32)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def assert_close_to_rounding(got: torch.Tensor, expected: torch.Tensor, ulps: int = 1) -> None:
    """Equal up to `ulps` units in the last place of the dtype (a reduction's order)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    tolerance = ulps * torch.finfo(got.dtype).eps * expected.float().abs().clamp_min(1e-3)
    assert ((got.float() - expected.float()).abs() <= tolerance).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_and_its_residual_add_match_the_torch_ops(dtype, width):
    torch.manual_seed(width)
    x, residual = (torch.randn(37, width) * 3).to(dtype), torch.randn(37, width).to(dtype)
    weight = (torch.rand(width) + 0.5).to(dtype)
    ulps = 4 if dtype == torch.float32 else 1  # float32: 1/rms's last bit, then two products
    assert_close_to_rounding(cpu_extension.rms_norm(x, weight, 1e-6),
                             torch_rms_norm(x, weight, 1e-6), ulps)
    x_in, residual_in = x.clone(), residual.clone()
    cpu_extension.add_rms_norm(x_in, residual_in, weight, 1e-6)
    assert torch.equal(residual_in, x + residual)  # one rounding, as torch's add
    assert_close_to_rounding(x_in, torch_rms_norm(x + residual, weight, 1e-6), ulps)
    if dtype != torch.float32:  # the sum of squares' order is all that may differ
        assert torch.equal(cpu_extension.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6))


def test_rms_norm_reads_strided_rows_and_leaves_them_alone():
    """q's heads are a strided view into the step's q|k|v output (Qwen3's q_norm)."""
    qkv = torch.randn(9, 3 * 64).to(torch.bfloat16)
    q = qkv[:, :128].view(9, 2, 64)
    weight = torch.rand(64).to(torch.bfloat16)
    before = qkv.clone()
    assert torch.equal(cpu_extension.rms_norm(q, weight, 1e-6), torch_rms_norm(q, weight, 1e-6))
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [24, 64, 128])
def test_rotary_in_place_equals_hugging_faces_rotate_half(dtype, head_dim):
    """Bit for bit in every dtype: each product and sum rounded where the torch ops round."""
    torch.manual_seed(head_dim)
    config = type("Config", (), {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    table = RotaryEmbedding(config, head_dim, 512).cos_sin
    num_tokens, num_heads, num_kv_heads = 21, 4, 2
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], -1)
    q, k = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 512, (num_tokens,))
    cos, sin = Rope(table, positions, dtype).cos_and_sin
    expected_q, expected_k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    value_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    cpu_extension.rotary(q, k, table, positions)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], value_before)


def test_rotary_refuses_a_position_past_its_table():
    table = torch.zeros(2, 8, 16)
    q, k = torch.zeros(2, 1, 16), torch.zeros(2, 1, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_extension.rotary(q, k, table, torch.tensor([0, 8]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [40, 1408])
def test_silu_and_mul_matches_the_torch_ops(dtype, width):
    torch.manual_seed(width)
    gate_up = (torch.randn(33, 2 * width) * 4).to(dtype)
    gate, up = gate_up.split(width, -1)
    got, expected = cpu_extension.silu_and_mul(gate_up), F.silu(gate) * up
    assert got.shape == (33, width)
    if dtype == torch.float32:  # exp's last bits (a polynomial here, Sleef in torch)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    else:
        assert_close_to_rounding(got, expected)


@pytest.mark.parametrize("heads_major", [True, False])
def test_store_kv_writes_the_references_slots(heads_major):
    num_blocks, block_size, num_kv_heads, head_dim = 64, 4, 2, 24

    def cache(width: int) -> torch.Tensor:
        if heads_major:  # the engine's CPU layout behind the logical view
            return torch.zeros(num_kv_heads, num_blocks, block_size, width).permute(1, 2, 0, 3)
        return torch.zeros(num_blocks, block_size, num_kv_heads, width)

    key_cache, value_cache = cache(head_dim), cache(16)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    qkv = torch.randn(30, 8 * head_dim)  # k and v as strided views, as the decoder has them
    key = qkv[:, :2 * head_dim].view(30, num_kv_heads, head_dim)
    value = qkv[:, 2 * head_dim:2 * head_dim + 32].view(30, num_kv_heads, 16)
    slots = torch.randperm(num_blocks * block_size)[:30]
    cpu_extension.store_kv(key, value, key_cache, value_cache, slots)
    store_kv_cache_ref(key, value, expected_k, expected_v, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_store_kv_refuses_a_slot_outside_the_cache_before_writing_any():
    key_cache, value_cache = torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8)
    key = value = torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_extension.store_kv(key, value, key_cache, value_cache, torch.tensor([0, 8]))
    assert not key_cache.any() and not value_cache.any()
