"""Batch-invariant kernels for CUDA (Triton): every output computed in an order fixed by the
model's shapes, never by the batch, the chunking or the row's place in it.

On a GPU the default kernels reduce in orders that follow the batch: cuBLAS picks its kernel,
tiles and split-K from M; torch's row reductions (the `mean` of an RMSNorm) split a row across
warps or blocks when there are few rows; the paged attention splits the KV of few long rows
across programs (flash-decoding) and sizes its tiles by whether the step holds a prefill. Here,
as in Thinking Machines' `batch_invariant_ops` and vLLM's batch-invariant mode:

- **linear** (`linear`): one tiled matmul with a fixed configuration (tile sizes, warps,
  stages) for every M, no split-K: each output is the chain of `tl.dot` steps over K in
  BLOCK_K pieces in increasing order, and the hardware computes a row of a tile the same way
  whatever the other rows hold (float32 runs exact FMA chains, "ieee", not TF32);
- **attention** (`paged_attention`, `dense_attention`): the paged kernel
  (`triton_paged_attention.py`) with one configuration, no KV split: a row's keys are taken in
  TILE_N-position tiles counted from the sequence's first position, in order, with one online
  softmax; tiles past a row's last key are exact no-ops for it (weight 0, rescale 1), so a token
  has the same bits decoded alone, in a prefill chunk of any length or from the prefix cache.
  A trainer's padded [B, H, L, D] tensors run through the same kernel: each row's real keys
  become a sequence of its own (a block table of one-position blocks over the padded tensor);
- **row reductions** (`mean_last_dim`, `log_softmax`, `softmax`): one program per row, the row
  read in ROW_BLOCK-wide pieces in order, lane by lane, then one fixed tree over the lanes.

Bits differ from the CPU kernels' (`kernels/csrc/batch_invariant_*.cpp`) and between GPU
generations; the engine and a trainer on one GPU agree. Callers: `rollout_engine.batch_invariant`
and `kernels.dispatch`, which route here for CUDA tensors (and for CPU tensors under
TRITON_INTERPRET=1 when ROLLOUT_ENGINE_BI_TRITON=1: the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_metadata import AttentionMetadata
from kernels.triton_paged_attention import LaunchConfig, _add, _max, paged_attention_launch
from kernels.triton_utils import check_device, is_interpreting

# One configuration for every call: the bits of a result depend on it (a GPU's MMA shape follows
# the tile and warp counts), so nothing here may choose it from the batch.
LINEAR_BLOCK_M, LINEAR_BLOCK_N, LINEAR_BLOCK_K = 64, 64, 32
LINEAR_WARPS, LINEAR_STAGES = 4, 3
ROW_BLOCK = 1024
ATTENTION_BLOCK_M = 16  # rows per program (tokens x query heads of one KV head), any step
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def attention_config(dtype: torch.dtype, head_dim: int) -> LaunchConfig:
    """The paged kernel's configuration in batch-invariant mode: a function of the model only."""
    tile_n = 64 if head_dim <= 128 and dtype != torch.float32 else 32
    return LaunchConfig(block_m=ATTENTION_BLOCK_M, tile_n=tile_n, num_splits=1, num_warps=4,
                        num_stages=2)


def _upcast(dtype: torch.dtype) -> bool:
    """Dots in float32 ("ieee"): float32 inputs, and the interpreter (numpy has no bfloat16)."""
    return is_interpreting() or dtype == torch.float32


def _check_dtype(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"the Triton batch-invariant kernels take {SUPPORTED_DTYPES}, "
                            f"not {t.dtype}")


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    out_ptr, x_ptr, w_ptr, bias_ptr,  # out [M, N], x [M, K], w [N, K], bias [N]
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # in increasing k, the same pieces for every M
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_cols + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias [N] -> [M, N] in x's dtype, each output in one order."""
    check_device(x, weight, *(() if bias is None else (bias,)))
    _check_dtype(x, weight)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear takes x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"x is {x.dtype}, weight {weight.dtype}: cast one (as F.linear asks)")
    (M, K), N = x.shape, weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    grid = (triton.cdiv(M, LINEAR_BLOCK_M), triton.cdiv(N, LINEAR_BLOCK_N))
    _linear_kernel[grid](
        out, x, weight, out if bias is None else bias.contiguous(), M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, UPCAST=_upcast(x.dtype),
        BLOCK_M=LINEAR_BLOCK_M, BLOCK_N=LINEAR_BLOCK_N, BLOCK_K=LINEAR_BLOCK_K,
        num_warps=LINEAR_WARPS, num_stages=LINEAR_STAGES,
    )
    return out


@triton.jit
def _row_mean_kernel(out_ptr, x_ptr, N, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.full([BLOCK], 0.0, dtype=tl.float32)
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        lanes += tl.load(x_ptr + row * stride_x + offs, mask=offs < N, other=0.0).to(tl.float32)
    total = tl.reduce(lanes, 0, _add)
    tl.store(out_ptr + row, (total / N).to(out_ptr.dtype.element_ty))


@triton.jit
def _row_softmax_kernel(out_ptr, x_ptr, N, stride_x, stride_o, LOG: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    # Per lane, a running maximum and a sum of exp(x - maximum), rescaled as the maximum grows.
    big = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    sums = tl.full([BLOCK], 0.0, dtype=tl.float32)
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < N,
                    other=float("-inf")).to(tl.float32)
        big_new = tl.maximum(big, x)
        ref = tl.where(big_new > float("-inf"), big_new, 0.0)  # a lane that saw only -inf
        sums = sums * tl.exp(big - ref) + tl.exp(x - ref)
        big = big_new
    top = tl.reduce(big, 0, _max)
    top = tl.where(top > float("-inf"), top, 0.0)
    total = tl.reduce(sums * tl.exp(big - top), 0, _add)
    log_total = tl.log(total)
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < N, other=0.0).to(tl.float32)
        if LOG:
            y = x - top - log_total
        else:
            y = tl.exp(x - top) / total
        tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=offs < N)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit stride along a row (the row kernels' layout)."""
    check_device(x)
    _check_dtype(x)
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()


def mean_last_dim(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """`x.mean(-1, keepdim)`, summed in float32."""
    rows = _rows(x)
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _row_mean_kernel[(rows.shape[0],)](out, rows, rows.shape[1], rows.stride(0),
                                           BLOCK=ROW_BLOCK, num_warps=4)
    shape = (*x.shape[:-1], 1) if keepdim else x.shape[:-1]
    return out.reshape(shape)


def _softmax(x: torch.Tensor, log: bool) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.numel():
        _row_softmax_kernel[(rows.shape[0],)](out, rows, rows.shape[1], rows.stride(0),
                                              out.stride(0), LOG=log, BLOCK=ROW_BLOCK,
                                              num_warps=4)
    return out.reshape(x.shape)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """`x.log_softmax(-1)`, in float32 inside."""
    return _softmax(x, log=True)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """`x.softmax(-1)`, in float32 inside."""
    return _softmax(x, log=False)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """`kernels.dispatch.paged_attention` with each token's bits fixed by its own keys."""
    _check_dtype(query)
    config = attention_config(query.dtype, max(query.shape[-1], value_cache.shape[-1]))
    return paged_attention_launch(query, key_cache, value_cache, metadata, scale, config,
                                  sliding_window, softcap, sinks)


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    visible: torch.Tensor | None, is_causal: bool, scale: float) -> torch.Tensor:
    """sdpa's layout (q [B, H, Lq, D], k [B, Hk, Lk, D], v [B, Hk, Lk, Dv]) through the paged
    kernel: row b's real keys, the run of positions its last query sees, are one sequence whose
    queries are the real ones among the last Lq positions; each query sees the keys up to its
    own (causal). `visible` (bool, broadcastable to [B, H, Lq, Lk]) must say exactly that for
    every real query (a padded causal mask, as Hugging Face builds); without it, is_causal
    needs Lq == Lk and no mask at all needs Lq == 1. Queries outside the run get zeros."""
    batch, num_heads, q_len, _ = query.shape
    k_len = key.shape[2]
    if visible is None:
        if (q_len != k_len) if is_causal else (q_len != 1):
            raise ValueError("batch-invariant attention on CUDA takes causal attention "
                             "(Lq == Lk) or one query over all keys without a mask")
        first = torch.zeros(batch, dtype=torch.long, device=query.device)
        count = torch.full_like(first, k_len)
    else:
        # The last query of a padded causal batch is never a fully masked row: its visible keys
        # are the row's real ones (left padding: it is the last real token; right padding: a
        # pad query that sees every real key).
        given = visible.expand(batch, num_heads, q_len, k_len)
        last = given[:, 0, -1]  # [B, Lk]
        first = last.int().argmax(-1).long()
        count = last.sum(-1)
        keys = torch.arange(k_len, device=query.device)
        run = (keys >= first[:, None]) & (keys < (first + count)[:, None])  # [B, Lk]
        q_keys = keys[k_len - q_len:]  # the key position of each query
        expected = run[:, None, :] & (keys[None, None, :] <= q_keys[None, :, None])
        real_query = run[:, k_len - q_len:]  # [B, Lq]
        agree = (given == expected[:, None]) | ~real_query[:, None, :, None]
        if not bool(agree.all()):
            raise ValueError("batch-invariant attention on CUDA takes causal masks over one "
                             "run of real keys per row (padding on either side), as Hugging "
                             "Face builds them; other masks (sliding windows, packed "
                             "sequences) are not supported yet")
    return _attend_runs(query, key, value, first, count, scale)


def _attend_runs(query, key, value, first, count, scale) -> torch.Tensor:
    """Row b's keys first[b] : first[b] + count[b] as one sequence, whose queries are those of
    the last Lq key positions that fall in it."""
    batch, num_heads, q_len, _ = query.shape
    num_kv_heads, k_len = key.shape[1], key.shape[2]
    device = query.device
    offset = k_len - q_len  # query i sits at key position offset + i
    q_first_key = torch.clamp(first, min=offset)
    real_queries = (first + count - q_first_key).clamp(min=0)  # [B]
    q_index = torch.arange(q_len, device=device)[None, :]
    q_first = (q_first_key - offset)[:, None]
    is_real = (q_index >= q_first) & (q_index < q_first + real_queries[:, None])  # [B, Lq]
    rows = is_real.flatten().nonzero()[:, 0]  # by row, then position: the requests' order
    query_start = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    query_start[1:] = torch.cumsum(real_queries, 0)
    flat_q = query.transpose(1, 2).reshape(batch * q_len, num_heads, -1)[rows]
    # One-position blocks: block j of row b is the padded tensor's position first[b] + j.
    key_rows = key.transpose(1, 2).reshape(batch * k_len, 1, num_kv_heads, -1)
    value_rows = value.transpose(1, 2).reshape(batch * k_len, 1, num_kv_heads, -1)
    seq_lens_cpu = count.tolist()
    positions = torch.arange(max(max(seq_lens_cpu, default=0), 1), device=device)
    tables = (torch.arange(batch, device=device)[:, None] * k_len + first[:, None]
              + positions[None, :]).clamp(max=max(batch * k_len - 1, 0)).to(torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
        query_start_loc=query_start, seq_lens=count.to(torch.int32), block_tables=tables,
        block_size=1, query_lens_cpu=real_queries.tolist(), seq_lens_cpu=seq_lens_cpu)
    flat_out = paged_attention(flat_q, key_rows.contiguous(), value_rows.contiguous(), metadata,
                               scale)
    out = query.new_zeros(batch * q_len, num_heads, value.shape[-1])
    out[rows] = flat_out
    return out.reshape(batch, q_len, num_heads, -1).transpose(1, 2)
