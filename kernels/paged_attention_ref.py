"""Torch reference for paged attention and the KV store: the CPU path and the GPU oracle.

Requests with short queries (decode rows, draft verification) are attended in one padded
batch; longer prefill chunks one at a time, so a long prompt never pads the others.

A sliding window W (a layer's setting, as Hugging Face's `sliding_window`) lets the token at
position p see the keys at positions p - W + 1 .. p only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata

# Requests with at most this many query tokens go into the padded batch.
MAX_BATCHED_QUERY_LEN = 16


def store_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write this step's K/V into their slots.

    key, value: [num_tokens, num_kv_heads, head_dim]
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: [num_tokens] int64
    """
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
        return
    block_size = key_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, offsets] = key
    value_cache[blocks, offsets] = value


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's queries over its paged KV (within `sliding_window`
    positions of each query, if given).

    query: [num_tokens, num_heads, head_dim]; returns the same shape. The KV of this
    step's tokens must already be stored (all of them, before any request attends, so a
    request may read blocks that another request of the same step writes).
    """
    out = torch.empty_like(query)
    plan = _plan(metadata, sliding_window)
    if plan["batched"] is not None:
        _attend_batched(query, key_cache, value_cache, plan["batched"], scale, out)
    for req, start, q_len, s_len in plan["single"]:
        table = metadata.block_tables[req]
        q = query[start : start + q_len]
        k = _gather_one(key_cache, table, s_len)
        v = _gather_one(value_cache, table, s_len)
        out[start : start + q_len] = _sdpa_causal(q, k, v, scale, sliding_window)
    return out


def _plan(metadata: AttentionMetadata, sliding_window: int | None) -> dict:
    """Split requests into the padded batch and single prefill chunks (once per step and
    window)."""
    key = ("ref_plan", sliding_window)
    if key in metadata.cache:
        return metadata.cache[key]
    starts = [0]  # from the host-side lengths: no device sync
    for q_len in metadata.query_lens_cpu:
        starts.append(starts[-1] + q_len)
    batched, single = [], []
    for i, (q_len, s_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
        if q_len <= MAX_BATCHED_QUERY_LEN:
            batched.append(i)
        else:
            single.append((i, starts[i], q_len, s_len))
    plan = {"batched": _batched_plan(metadata, batched, starts, sliding_window) if batched
            else None, "single": single}
    metadata.cache[key] = plan
    return plan


def _batched_plan(
    metadata: AttentionMetadata, reqs: list[int], starts: list[int], sliding_window: int | None
) -> dict:
    device = metadata.block_tables.device
    q_lens = [metadata.query_lens_cpu[i] for i in reqs]
    s_lens = [metadata.seq_lens_cpu[i] for i in reqs]
    max_q, max_s = max(q_lens), max(s_lens)
    num_blocks = -(-max_s // metadata.block_size)
    # [B, max_q]: flat query row of each (request, query index); padding points at row 0.
    rows = torch.zeros(len(reqs), max_q, dtype=torch.int64)
    for b, (i, q_len) in enumerate(zip(reqs, q_lens)):
        rows[b, :q_len] = torch.arange(starts[i], starts[i] + q_len)
    q_lens_t = torch.tensor(q_lens).view(-1, 1)
    s_lens_t = torch.tensor(s_lens).view(-1, 1)
    q_pos = s_lens_t - q_lens_t + torch.arange(max_q).view(1, -1)  # [B, max_q]
    k_pos = torch.arange(num_blocks * metadata.block_size).view(1, 1, -1)
    # [B, 1, max_q, L]: causal within the request, nothing past its KV length.
    mask = (k_pos <= q_pos.unsqueeze(-1)) & (k_pos < s_lens_t.unsqueeze(-1))
    if sliding_window:
        mask &= k_pos > q_pos.unsqueeze(-1) - sliding_window
    valid = torch.arange(max_q).view(1, -1) < q_lens_t
    return {
        "rows": rows.to(device),
        "valid": valid.to(device),
        "flat_rows": rows[valid].to(device),
        "mask": mask.unsqueeze(1).to(device),
        "tables": metadata.block_tables[torch.tensor(reqs, device=device), :num_blocks].long(),
    }


def _attend_batched(query, key_cache, value_cache, plan, scale, out) -> None:
    tables = plan["tables"]  # [B, nb]
    num_reqs, num_blocks = tables.shape
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    # [B, nb, bs, Hkv, D] -> [B, Hkv, L, D]
    k = key_cache[tables].reshape(num_reqs, num_blocks * block_size, num_kv_heads, head_dim)
    v = value_cache[tables].reshape(num_reqs, num_blocks * block_size, num_kv_heads, head_dim)
    q = query[plan["rows"]]  # [B, max_q, H, D]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=plan["mask"], scale=scale, enable_gqa=True,
    )  # [B, H, max_q, D]
    out[plan["flat_rows"]] = o.transpose(1, 2)[plan["valid"]]


def _gather_one(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, Hkv, D] of one request's KV, in position order."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[table[:num_blocks].long()]  # [nb, bs, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def _sdpa_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None
) -> torch.Tensor:
    """q: [q_len, H, D] at the last q_len positions of k, v: [s_len, Hkv, D]."""
    return sdpa_causal_heads_major(q, k.transpose(0, 1), v.transpose(0, 1), scale, sliding_window)


def sdpa_causal_heads_major(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [q_len, H, D] at the last q_len positions of k, v: [Hkv, s_len, D]."""
    q_len, s_len = q.shape[0], k.shape[1]
    if q_len == s_len and not sliding_window:
        mask, is_causal = None, True
    else:
        q_pos = torch.arange(s_len - q_len, s_len, device=q.device).view(-1, 1)
        k_pos = torch.arange(s_len, device=q.device).view(1, -1)
        mask, is_causal = k_pos <= q_pos, False  # [q_len, s_len]
        if sliding_window:
            mask &= k_pos > q_pos - sliding_window
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
        attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True,
    )  # [1, H, q_len, D]
    return o[0].transpose(0, 1)
