"""Triton paged attention for a mixed batch (decode rows and prefill chunks) in one launch.

Each program owns one tile of query tokens of one request and one KV head: its
`BLOCK_M` rows are `BLOCK_Q` query tokens x the `group` query heads sharing that KV head
(GQA), so K/V are read once per group. It walks the request's KV in `TILE_N`-position
tiles through the block table with an online softmax in fp32. Programs are numbered so
that request r's tiles start at `query_start_loc[r] // BLOCK_Q + r`, which lets a
program find its request by binary search: the grid depends only on the number of
tokens and requests, never on a host-side plan. When few programs would cover a long
KV (small decode batches), each one is also split along the KV and a second kernel
merges the partial softmaxes (flash-decoding). With a sliding window W, a tile starts at the
first KV tile its first row may see: the keys before it are never read.

Values may be narrower or wider than keys (multi-head latent attention: HEAD_DIM_V beside
HEAD_DIM). A logit softcap (SOFTCAP) bends each score to c * tanh(s / c) in natural-log units
before it joins the base-2 softmax. Sinks (HAS_SINKS, one logit per query head) start a row's
running softmax at m = sink, l = 1 when one program sees the whole KV; with KV splits no split
counts them and the merge adds them once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_metadata import AttentionMetadata
from kernels.triton_utils import (
    check_device,
    dot_precision,
    is_interpreting,
    next_power_of_2,
    num_sms,
)

LOG2_E = 1.4426950408889634
# Splitting the KV pays only when a split still gets a few tiles to work on.
MIN_TILES_PER_SPLIT = 4
MAX_NUM_SPLITS = 16


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of one launch; `num_splits > 1` splits each program's KV range."""

    block_m: int
    tile_n: int
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2


# The kernels call only Triton builtins and jit functions of this module, never the
# jit-defined helpers of triton.language (tl.cdiv, tl.max, tl.sum, tl.zeros): those are
# compiled or interpreted depending on TRITON_INTERPRET when Triton is first imported,
# so using them would tie these kernels to whichever mode that happened to be.
@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


if is_interpreting():
    # The interpreter reduces element by element in Python unless the combine function is
    # one it knows (then numpy does it); it recognises them by identity, never calls them.
    _max = getattr(tl.standard, "_elementwise_max", _max)
    _add = getattr(tl.standard, "_sum_combine", _add)


@triton.jit
def _tanh(x):
    """tanh in fp32 from builtins (`tl.math.tanh` is not in every Triton): below |x| = 0.625 an
    odd polynomial (a least-squares fit, relative error under 5e-9), where 1 - 2 / (exp(2|x|) + 1)
    would cancel; that formula above it, with |x| clamped at 15 (tanh(15) is 1 in fp32) so that
    exp never overflows."""
    a = tl.abs(x)
    u = a * a
    p = -5.691985663248322e-3 * u + 2.0626291823316753e-2
    p = p * u - 5.373531884945931e-2
    p = p * u + 1.3331381354360305e-1
    p = p * u - 3.3333279208370575e-1
    near_zero = a + a * u * p
    far = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(a, 15.0)) + 1.0)
    t = tl.where(a < 0.625, near_zero, far)
    return tl.where(x < 0, -t, t)


@triton.jit
def _find_request(query_start_loc_ptr, pid, num_reqs, BLOCK_Q: tl.constexpr):
    """The last request r with query_start_loc[r] // BLOCK_Q + r <= pid."""
    lo: tl.int32 = 0
    hi = lo + num_reqs  # a tensor even when num_reqs == 1 arrives as a constant
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_reqs"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim_v]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    block_tables_ptr,  # [num_reqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    sinks_ptr,  # [num_heads] (HAS_SINKS and NUM_SPLITS == 1 only)
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_V_PAD] fp32 (splits only)
    partial_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32 (splits only)
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32 (splits only)
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    softcap_scale,  # softmax scale / softcap: a score's tanh argument (SOFTCAP only)
    softcap_log2,  # softcap * log2(e): tanh back to a base-2 score (SOFTCAP only)
    sliding_window,  # W: a row sees keys in (q_pos - W, q_pos]; read only when SLIDING
    num_reqs,
    num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,  # of queries and keys
    HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,  # of values and the output
    HEAD_DIM_V_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q tokens x GROUP heads, padded
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,  # KV positions per inner step
    NUM_SPLITS: tl.constexpr,
    SLIDING: tl.constexpr,  # the layer has a sliding window
    SOFTCAP: tl.constexpr,  # the layer softcaps its scores
    HAS_SINKS: tl.constexpr,  # the layer has sinks
    UPCAST: tl.constexpr,  # compute the dots in fp32 (interpreter, or fp32 inputs)
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, pid, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= q_len:  # one of the spare programs of the grid
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] token index within the request
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    row_ok = (offs_m // GROUP < BLOCK_Q) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    token = (q_start + q_idx).to(tl.int64)
    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(query_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + q_idx  # [BLOCK_M] absolute position: sees keys at <= q_pos

    # The last query token of this tile bounds the keys any row of it may see, and with a
    # sliding window its first token's window the earliest.
    kv_end = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    end_tile = (kv_end + TILE_N - 1) // TILE_N
    first_tile = end_tile * 0
    if SLIDING:
        first_tile = tl.maximum(context_len + q_tile * BLOCK_Q - sliding_window + 1, 0) // TILE_N
    tiles_per_split = (end_tile - first_tile + NUM_SPLITS - 1) // NUM_SPLITS
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, end_tile)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    if HAS_SINKS and NUM_SPLITS == 1:  # with splits, the merge adds the sinks
        # The sink is a key seen first, of logit sinks[head] and value 0: m = sink, l = 1.
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        m_i = sink * 1.4426950408889634  # base 2
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_V_PAD], 0.0, dtype=tl.float32)
    table_ptr = block_tables_ptr + req * stride_bt
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] key positions
        n_ok = offs_n < kv_end
        block = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k_offs = block[None, :] * stride_kb + in_block[None, :] * stride_ks + offs_d[:, None]
        k = tl.load(key_cache_ptr + kv_head * stride_kh + k_offs,
                    mask=d_ok[:, None] & n_ok[None, :], other=0.0)  # [HEAD_DIM_PAD, TILE_N]
        v_offs = block[:, None] * stride_vb + in_block[:, None] * stride_vs + offs_dv[None, :]
        v = tl.load(value_cache_ptr + kv_head * stride_vh + v_offs,
                    mask=n_ok[:, None] & dv_ok[None, :], other=0.0)  # [TILE_N, HEAD_DIM_V_PAD]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N]
        if SOFTCAP:  # c * tanh(scale * s / c), then base 2
            s = _tanh(s * softcap_scale) * softcap_log2
        else:
            s = s * scale_log2
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if SLIDING:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max))
        # A row that has seen no key yet (a padding row) keeps a finite reference point.
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.reduce(p, 1, _add)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dv_ok[None, :])
    else:
        row = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(partial_max_ptr + row, m_i, mask=row_ok)
        tl.store(partial_sum_ptr + row, l_i, mask=row_ok)
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM_V_PAD + offs_dv[None, :], acc,
                 mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim_v]
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_V_PAD] fp32
    partial_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    sinks_ptr,  # [num_heads] (HAS_SINKS only)
    num_heads,
    stride_ot, stride_oh,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    rows = (token * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)  # [NUM_SPLITS]
    offs_d = tl.arange(0, HEAD_DIM_V_PAD)
    m = tl.load(partial_max_ptr + rows)
    # Some split holds the row's own key, so the maximum is finite; splits it sees nothing of
    # (empty, or outside its sliding window) weigh exp2(-inf) = 0.
    m_max = tl.reduce(m, 0, _max)
    if HAS_SINKS:  # the sink, counted by no split, joins the softmax here: once
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # base 2
        m_max = tl.maximum(m_max, sink)
    weight = tl.exp2(m - m_max)
    total = tl.reduce(tl.load(partial_sum_ptr + rows) * weight, 0, _add)
    if HAS_SINKS:
        total += tl.exp2(sink - m_max)
    acc = tl.load(partial_out_ptr + rows[:, None] * HEAD_DIM_V_PAD + offs_d[None, :])
    out = tl.reduce(acc * weight[:, None], 0, _add) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM_V)


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's queries over its paged KV (within `sliding_window`
    positions of each query, with scores softcapped by `softcap` and a sink logit per head,
    if given: see `paged_attention_ref`).

    query: [num_tokens, num_heads, head_dim]; returns [num_tokens, num_heads, value_head_dim].
    The KV of this step's tokens must already be stored.
    """
    # Every layer of a step sees the same shapes (a model whose layers differ in value width
    # gets a config per width): choose once per step.
    key = ("triton_attention_config", query.shape, query.dtype, key_cache.shape,
           value_cache.shape[-1])
    config = metadata.cache.get(key)
    if config is None:
        config = metadata.cache[key] = choose_config(query, key_cache, metadata,
                                                     value_cache.shape[-1])
    return paged_attention_launch(query, key_cache, value_cache, metadata, scale, config,
                                  sliding_window, softcap, sinks)


def choose_config(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    metadata: AttentionMetadata,
    value_head_dim: int | None = None,
) -> LaunchConfig:
    """Tile sizes for this batch: taller tiles for prefill, KV splits for few long rows.
    `value_head_dim`: the values' width when it is not the keys'."""
    num_tokens, num_heads, head_dim = query.shape
    head_dim = max(head_dim, value_head_dim or head_dim)  # the wider tile sets the limits
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    is_prefill = metadata.max_query_len > 16
    block_m = max(64 if is_prefill else 16, next_power_of_2(group))
    tile_n = 64 if head_dim <= 128 and query.dtype != torch.float32 else 32
    if is_interpreting() or not query.is_cuda or is_prefill:
        num_warps = 8 if is_prefill and head_dim > 128 else 4
        return LaunchConfig(block_m=block_m, tile_n=tile_n, num_warps=num_warps)
    block_q = block_m // group
    num_programs = (num_tokens // block_q + metadata.num_reqs) * num_kv_heads
    target = 2 * num_sms(query.device.index or 0)
    max_tiles = -(-metadata.max_seq_len // tile_n)
    num_splits = min(MAX_NUM_SPLITS, -(-target // num_programs), max_tiles // MIN_TILES_PER_SPLIT)
    num_splits = 1 if num_splits < 2 else next_power_of_2(num_splits + 1) // 2  # round down
    return LaunchConfig(block_m=block_m, tile_n=tile_n, num_splits=num_splits)


def paged_attention_launch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    config: LaunchConfig,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention_triton` with explicit tile sizes (tests and benchmarks pick them)."""
    check_device(query, key_cache, value_cache, metadata.block_tables)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, head_dim_v = key_cache.shape[2], value_cache.shape[3]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert key_cache.shape[3] == head_dim, (key_cache.shape, query.shape)
    assert value_cache.shape[:3] == key_cache.shape[:3], (value_cache.shape, key_cache.shape)
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "cache rows must be dense"
    assert config.num_splits & (config.num_splits - 1) == 0, config
    assert sinks is None or sinks.shape == (num_heads,), (None if sinks is None else sinks.shape)
    out = torch.empty(num_tokens, num_heads, head_dim_v, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    if sinks is not None:
        check_device(sinks)
        sinks = sinks.contiguous()
    group = num_heads // num_kv_heads
    block_m = max(config.block_m, next_power_of_2(group))
    block_q = block_m // group
    head_dim_pad = max(16, next_power_of_2(head_dim))
    head_dim_v_pad = max(16, next_power_of_2(head_dim_v))
    num_splits = config.num_splits
    if num_splits > 1:
        partial_out = torch.empty(num_tokens, num_heads, num_splits, head_dim_v_pad,
                                  dtype=torch.float32, device=query.device)
        partial_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                                  device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:  # the kernel never touches them
        partial_out = partial_max = partial_sum = out
    grid = (num_tokens // block_q + metadata.num_reqs, num_kv_heads, num_splits)
    upcast = is_interpreting() or query.dtype == torch.float32
    softcap = softcap or 0.0  # None or 0: none
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache,
        metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
        out if sinks is None else sinks,  # never read without sinks
        partial_out, partial_max, partial_sum,
        scale * LOG2_E, scale / softcap if softcap else 0.0, softcap * LOG2_E,
        sliding_window or 0, metadata.num_reqs, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        metadata.block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        HEAD_DIM_V=head_dim_v, HEAD_DIM_V_PAD=head_dim_v_pad,
        BLOCK_SIZE=key_cache.shape[1], BLOCK_M=block_m, BLOCK_Q=block_q,
        TILE_N=config.tile_n, NUM_SPLITS=num_splits, SLIDING=bool(sliding_window),
        SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else dot_precision(query.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, partial_out, partial_max, partial_sum, out if sinks is None else sinks,
            num_heads, out.stride(0), out.stride(1),
            HEAD_DIM_V=head_dim_v, HEAD_DIM_V_PAD=head_dim_v_pad, NUM_SPLITS=num_splits,
            HAS_SINKS=sinks is not None,
        )
    return out
