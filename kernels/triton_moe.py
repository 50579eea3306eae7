"""Triton fused mixture-of-experts: a step's tokens through their routed experts in two grouped
GEMM launches, each program one expert's block of rows (vLLM's fused_moe layout).

The (token, expert) pairs are sorted by expert and each expert's run is padded to whole blocks
of `BLOCK_M` rows (`_align_to_blocks`, torch ops on the device, no host sync, so a CUDA graph
can hold it: the grid is sized for the worst case and blocks past the last expert return).
The first launch computes gate and up tiles of a block against its expert's concatenated
[2 I, H] weight and writes silu(gate) * up; the second multiplies that by the expert's down
[H, I] weight and by the pair's routing weight. The k pairs of a token are summed in a fixed
order in float32 at the end, with no atomics, so the result does not depend on the launch
order. The layout is transformers' default experts layout (gate|up concatenated, no biases,
SiLU), the one `rollout_engine/worker/models/experts.py` sends here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import check_device, dot_precision, is_interpreting

_BLOCK_N = 64
"""Output columns per program."""
_BLOCK_K = 32
"""Reduction step (hidden or intermediate features)."""


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: small for decode (a few pairs per expert), larger for prefill."""
    return 16 if num_pairs <= 16 * num_experts else 64


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2 I, H]
    inter_ptr,  # [T k, I]
    pair_ids_ptr,  # [num_blocks * BLOCK_M] int32, -1: padding
    block_experts_ptr,  # [num_blocks] int32, -1: past the last expert
    top_k, hidden_size, intermediate_size,
    stride_xt, stride_we, stride_wn, stride_it,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # the dots in float32 (the interpreter has no bfloat16 dots)
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = pairs >= 0
    tokens = tl.where(row_mask, pairs // top_k, 0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = ns < intermediate_size
    w_expert = w_ptr + expert * stride_we
    gate = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    up = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden_size
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        tile_mask = k_mask[:, None] & n_mask[None, :]
        w_gate = tl.load(w_expert + ns[None, :] * stride_wn + ks[:, None], mask=tile_mask,
                         other=0.0)  # [BLOCK_K, BLOCK_N]
        w_up = tl.load(w_expert + (ns[None, :] + intermediate_size) * stride_wn + ks[:, None],
                       mask=tile_mask, other=0.0)
        if UPCAST:
            a, w_gate, w_up = a.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        gate += tl.dot(a, w_gate, input_precision=DOT_PRECISION)
        up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
    # transformers rounds the projections to the weights' dtype before the activation
    gate = gate.to(inter_ptr.dtype.element_ty).to(tl.float32)
    up = up.to(inter_ptr.dtype.element_ty).to(tl.float32)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(inter_ptr + pairs[:, None] * stride_it + ns[None, :],
             h.to(inter_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    inter_ptr,  # [T k, I]
    w_ptr,  # [E, H, I]
    weights_ptr,  # [T k] routing weights
    out_ptr,  # [T k, H] float32
    pair_ids_ptr, block_experts_ptr,
    hidden_size, intermediate_size,
    stride_it, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # the dots in float32 (the interpreter has no bfloat16 dots)
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = pairs >= 0
    rows = tl.where(row_mask, pairs, 0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = ns < hidden_size
    w_expert = w_ptr + expert * stride_we
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, intermediate_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < intermediate_size
        a = tl.load(inter_ptr + rows[:, None] * stride_it + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_expert + ns[None, :] * stride_wn + ks[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    acc = acc.to(inter_ptr.dtype.element_ty).to(tl.float32)
    routing = tl.load(weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + pairs[:, None] * stride_ot + ns[None, :], acc * routing[:, None],
             mask=row_mask[:, None] & n_mask[None, :])


def _align_to_blocks(top_k_index: torch.Tensor, num_experts: int,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert, each expert's run padded to whole blocks: (pair ids
    [num_blocks * block_m], -1 on padding; the expert of each block [num_blocks], -1 past the
    last), num_blocks the worst case ceil(pairs / block_m) + experts."""
    experts = top_k_index.flatten().long()  # [P]: pair p = token * k + j
    num_pairs, device = experts.numel(), experts.device
    num_blocks = triton.cdiv(num_pairs, block_m) + num_experts
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))  # bincount would sync the host
    blocks_per_expert = (counts + block_m - 1) // block_m
    block_ends = blocks_per_expert.cumsum(0)
    first_block = block_ends - blocks_per_expert
    order = torch.sort(experts, stable=True).indices  # [P] pair ids, by expert
    sorted_experts = experts[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    pair_ids = torch.full((num_blocks * block_m,), -1, dtype=torch.int32, device=device)
    pair_ids[first_block[sorted_experts] * block_m + rank] = order.to(torch.int32)
    block_experts = torch.searchsorted(block_ends, torch.arange(num_blocks, device=device),
                                       right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return pair_ids, block_experts.to(torch.int32)


def fused_moe_triton(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x [T, H], top_k_index / top_k_weights [T, k], gate_up [E, 2 I, H], down [E, H, I] ->
    sum_j top_k_weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])), e =
    top_k_index[t, j], as [T, H] in x's dtype."""
    check_device(x, top_k_index, top_k_weights, gate_up, down)
    num_tokens, hidden_size = x.shape
    top_k = top_k_index.shape[1]
    num_experts, intermediate_size = gate_up.shape[0], gate_up.shape[1] // 2
    if gate_up.shape[2] != hidden_size or down.shape != (num_experts, hidden_size,
                                                         intermediate_size):
        raise ValueError(f"expert weights {tuple(gate_up.shape)} / {tuple(down.shape)} do not "
                         f"fit hidden size {hidden_size}")
    if num_tokens == 0:
        return x.new_empty(0, hidden_size)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    block_m = _block_m(num_tokens * top_k, num_experts)
    pair_ids, block_experts = _align_to_blocks(top_k_index, num_experts, block_m)
    num_blocks = block_experts.numel()
    inter = x.new_empty(num_tokens * top_k, intermediate_size)
    upcast = is_interpreting() or x.dtype == torch.float32
    precision = "ieee" if upcast else dot_precision(x.dtype)
    _gate_up_kernel[(num_blocks, triton.cdiv(intermediate_size, _BLOCK_N))](
        x, gate_up, inter, pair_ids, block_experts, top_k, hidden_size, intermediate_size,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), inter.stride(0),
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, UPCAST=upcast,
        DOT_PRECISION=precision,
    )
    out = torch.empty(num_tokens * top_k, hidden_size, dtype=torch.float32, device=x.device)
    weights = top_k_weights.reshape(-1).contiguous()
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, _BLOCK_N))](
        inter, down, weights, out, pair_ids, block_experts, hidden_size, intermediate_size,
        inter.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, UPCAST=upcast,
        DOT_PRECISION=precision,
    )
    return out.view(num_tokens, top_k, hidden_size).sum(1).to(x.dtype)
