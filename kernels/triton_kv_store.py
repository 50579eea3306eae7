"""Triton kernel writing this step's K/V into the paged cache; same signature as the reference.

Key and value rows may differ in width (multi-head latent attention): each is read and
written with its own (HEAD_DIM, HEAD_DIM_V).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import check_device, next_power_of_2


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim_v]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token: nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src = offs_h[:, None] * stride_kh + offs_d[None, :]
    k = tl.load(key_ptr + token * stride_kt + src, mask=mask)
    dst = block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_dv[None, :] < HEAD_DIM_V)
    src = offs_h[:, None] * stride_vh + offs_dv[None, :]
    v = tl.load(value_ptr + token * stride_vt + src, mask=mask)
    dst = block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_dv[None, :]
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write this step's K/V into their slots (a negative slot is skipped).

    key: [num_tokens, num_kv_heads, head_dim]; value: [num_tokens, num_kv_heads, head_dim_v]
    key_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: [num_blocks, block_size, num_kv_heads, head_dim_v]
    slot_mapping: [num_tokens] int64
    """
    check_device(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    head_dim_v = value.shape[2]
    assert value.shape[:2] == key.shape[:2], (value.shape, key.shape)
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), (key_cache.shape, key.shape)
    assert value_cache.shape[:3] == key_cache.shape[:3], (value_cache.shape, key_cache.shape)
    assert value_cache.shape[3] == head_dim_v, (value_cache.shape, value.shape)
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "cache rows must be dense"
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        HEAD_DIM_V=head_dim_v,
        HEAD_DIM_V_PAD=next_power_of_2(head_dim_v),
    )
