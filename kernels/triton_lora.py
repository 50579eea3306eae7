"""Triton kernels adding a step's LoRA deltas in place, each token under its own adapter slot
(Punica's BGMV: one program per token and output tile, the slot's weights read by index).

Two launches per LoRA point: a shrink (every token's x against its slot's stacked A rows, into
a float32 buffer) and, per linear, an expand (the token's block of that buffer against its
slot's B transposed, added into the linear's output). The layout is the CPU kernel's
(`kernels/csrc/lora_cpu.cpp`, see `rollout_engine/worker/lora/slots.py`): A [slots, columns,
in], where linear i of a slot uses rows [block * rank, (block + 1) * rank) with block =
linear_blocks[slot, i] (-1: not targeted) and rank = ranks[slot]; bt[i] [slots, max rank,
out_i] with the scaling folded in. Tokens of the base model (slot -1) cost one load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_paged_attention import _add  # builtins only (see that module)
from kernels.triton_utils import check_device, next_power_of_2

_BLOCK_K = 64
"""Input features per step of the shrink's reduction."""
_MAX_TILE = 8192
"""Elements of a weight tile one program holds (rows x columns)."""


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [num_tokens, in]
    a_ptr,  # [slots, columns, in]
    shrunk_ptr,  # [num_tokens, columns] float32
    row_slots_ptr,  # [num_tokens] int32, -1: the base model
    slot_rows_ptr,  # [slots] int32: rows of A the slot uses
    in_features,
    stride_xt, stride_as, stride_ar, stride_st,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(row_slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < tl.load(slot_rows_ptr + slot)
    acc = tl.full([BLOCK_R], 0.0, tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < in_features
        x = tl.load(x_ptr + token * stride_xt + ks, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + rows[:, None] * stride_ar + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.reduce(a * x[None, :], 1, _add)
    tl.store(shrunk_ptr + token * stride_st + rows, acc, mask=row_mask)


@triton.jit
def _lora_expand_kernel(
    shrunk_ptr,  # [num_tokens, columns] float32
    bt_ptr,  # [slots, max rank, out]
    out_ptr,  # [num_tokens, out] (a row stride of its own: a view into a packed output)
    row_slots_ptr,  # [num_tokens] int32
    blocks_ptr,  # [slots, linears] int32
    ranks_ptr,  # [slots] int32
    linear,
    out_features,
    stride_st, stride_bs, stride_br, stride_ot, stride_blk,
    BLOCK_RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(row_slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = tl.load(blocks_ptr + slot * stride_blk + linear).to(tl.int64)
    if block < 0:
        return
    rank = tl.load(ranks_ptr + slot).to(tl.int64)
    rs = tl.arange(0, BLOCK_RANK)
    r_mask = rs < rank
    s = tl.load(shrunk_ptr + token * stride_st + block * rank + rs, mask=r_mask, other=0.0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = ns < out_features
    b = tl.load(bt_ptr + slot * stride_bs + rs[:, None] * stride_br + ns[None, :],
                mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    delta = tl.reduce(b * s[:, None], 0, _add)
    out_ptrs = out_ptr + token * stride_ot + ns
    out = tl.load(out_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (out + delta).to(out_ptr.dtype.element_ty), mask=n_mask)


def lora_add_triton(x: torch.Tensor, a: torch.Tensor, bt: list[torch.Tensor],
                    outs: list[torch.Tensor], row_slots: torch.Tensor,
                    linear_blocks: torch.Tensor, ranks: torch.Tensor) -> None:
    """outs[i][t] += bt[i][slot, :rank].T @ (a[slot, block rows] @ x[t]) for every token t with
    slot = row_slots[t] >= 0 and each linear i the slot targets (see the module doc). x [T, in];
    outs[i] [T, out_i] with unit inner strides; indexes int32 on x's device."""
    check_device(x, a, *bt, *outs, row_slots, linear_blocks, ranks)
    num_tokens, in_features = x.shape
    if num_tokens == 0:
        return
    if x.stride(-1) != 1 or any(o.stride(-1) != 1 for o in outs):
        raise ValueError("lora_add_triton needs unit inner strides")
    columns, max_rank = a.shape[1], bt[0].shape[1]
    slot_rows = ((linear_blocks.max(dim=1).values + 1) * ranks).to(torch.int32)
    shrunk = torch.empty(num_tokens, columns, dtype=torch.float32, device=x.device)
    block_r = min(next_power_of_2(columns), _MAX_TILE // _BLOCK_K)
    _lora_shrink_kernel[(num_tokens, triton.cdiv(columns, block_r))](
        x, a, shrunk, row_slots, slot_rows, in_features,
        x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0),
        BLOCK_R=block_r, BLOCK_K=_BLOCK_K,
    )
    block_rank = next_power_of_2(max_rank)
    for i, (b, out) in enumerate(zip(bt, outs)):
        block_n = max(16, min(256, _MAX_TILE // block_rank))
        _lora_expand_kernel[(num_tokens, triton.cdiv(out.shape[1], block_n))](
            shrunk, b, out, row_slots, linear_blocks, ranks, i, out.shape[1],
            shrunk.stride(0), b.stride(0), b.stride(1), out.stride(0), linear_blocks.stride(0),
            BLOCK_RANK=block_rank, BLOCK_N=block_n,
        )
