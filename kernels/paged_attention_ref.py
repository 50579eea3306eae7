"""Torch reference for paged attention and the KV store: the CPU path and the GPU oracle.

Requests with short queries (decode rows, draft verification) are attended in one padded
batch; longer prefill chunks one at a time, so a long prompt never pads the others.

A sliding window W (a layer's setting, as Hugging Face's `sliding_window`) lets the token at
position p see the keys at positions p - W + 1 .. p only.

Two more layer settings, as Hugging Face computes them: a logit softcap c (Gemma 2's
`attn_logit_softcapping`) turns each scaled score s into c * tanh(s / c) before the mask; sinks
(gpt-oss's `s_aux`, one logit per query head) add a column to each row's softmax whose value
vector is zero, so a row may attend to "nothing" in part. Values may be narrower or wider than
keys (multi-head latent attention): query [T, H, Dk], keys [.., Dk], values [.., Dv], output
[T, H, Dv]. A softcap of None or 0 is none. SDPA has neither softcap nor sinks: with either, an
explicit matmul-softmax-matmul runs instead, in float32 (float64 for float64 inputs); the plain
case keeps SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata

# Requests with at most this many query tokens go into the padded batch.
MAX_BATCHED_QUERY_LEN = 16
# The explicit path (softcap or sinks) takes a long prefill chunk's query rows in slices whose
# float32 scores hold at most this many elements (256 MiB), not all at once.
MAX_EXPLICIT_SCORES = 1 << 26


def store_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write this step's K/V into their slots.

    key: [num_tokens, num_kv_heads, head_dim]; value: [num_tokens, num_kv_heads, value_head_dim]
    key_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: [num_blocks, block_size, num_kv_heads, value_head_dim]
    slot_mapping: [num_tokens] int64
    """
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        key_cache.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key)
        value_cache.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value)
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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's queries over its paged KV (within `sliding_window`
    positions of each query, if given; scores softcapped by `softcap` and each head's softmax
    given the extra logit `sinks[h]`, if given: see the module's docstring).

    query: [num_tokens, num_heads, head_dim]; caches as in `store_kv_cache_ref`; sinks:
    [num_heads], any float dtype; returns [num_tokens, num_heads, value_head_dim]. The KV of
    this step's tokens must already be stored (all of them, before any request attends, so a
    request may read blocks that another request of the same step writes).
    """
    out = query.new_empty(*query.shape[:2], value_cache.shape[-1])  # [T, H, Dv]
    # The plan depends on the window only: the softcap and sinks change no index or mask.
    plan = _plan(metadata, sliding_window)
    if plan["batched"] is not None:
        _attend_batched(query, key_cache, value_cache, plan["batched"], scale, out, softcap,
                        sinks)
    for req, start, q_len, s_len in plan["single"]:
        table = metadata.block_tables[req]
        q = query[start : start + q_len]
        k = _gather_one(key_cache, table, s_len)
        v = _gather_one(value_cache, table, s_len)
        out[start : start + q_len] = _sdpa_causal(q, k, v, scale, sliding_window, softcap, sinks)
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


def _attend_batched(query, key_cache, value_cache, plan, scale, out, softcap=None,
                    sinks=None) -> None:
    tables = plan["tables"]  # [B, nb]
    num_reqs, num_blocks = tables.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    length = num_blocks * block_size
    # [B, nb, bs, Hkv, D] -> [B, L, Hkv, D] (D: Dk for keys, Dv for values)
    k = key_cache[tables].reshape(num_reqs, length, num_kv_heads, key_cache.shape[-1])
    v = value_cache[tables].reshape(num_reqs, length, num_kv_heads, value_cache.shape[-1])
    q = query[plan["rows"]]  # [B, max_q, H, Dk]
    o = attention_heads_major(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), plan["mask"], scale,
        softcap=softcap, sinks=sinks,
    )  # [B, H, max_q, Dv]
    out[plan["flat_rows"]] = o.transpose(1, 2)[plan["valid"]]


def attention_heads_major(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, Q, Dk], k [B, Hkv, L, Dk], v [B, Hkv, L, Dv], mask (True: seen) broadcast to
    [B, H, Q, L] -> [B, H, Q, Dv]: SDPA, or without it when a softcap or sinks are set."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    batch, num_heads, num_rows, head_dim = q.shape
    num_kv_heads, length = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    compute = torch.promote_types(q.dtype, torch.float32)  # float64 stays (the GPU oracle)
    # Heads h = kv * group + j share KV head kv: [B, Hkv, group * Q, Dk]
    qf = q.to(compute).reshape(batch, num_kv_heads, group * num_rows, head_dim)
    scores = torch.matmul(qf, k.to(compute).transpose(-1, -2)) * scale  # [B, Hkv, group * Q, L]
    scores = scores.view(batch, num_heads, num_rows, length)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # Hugging Face's way: a sink column in the softmax, then dropped
        sink = sinks.to(compute).view(1, num_heads, 1, 1).expand(batch, num_heads, num_rows, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :length]
    else:
        probs = scores.softmax(-1)
    probs = probs.reshape(batch, num_kv_heads, group * num_rows, length)
    o = torch.matmul(probs, v.to(compute))  # [B, Hkv, group * Q, Dv]
    return o.view(batch, num_heads, num_rows, v.shape[-1]).to(q.dtype)


def _gather_one(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, Hkv, D] of one request's KV, in position order."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[table[:num_blocks].long()]  # [nb, bs, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def _sdpa_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [q_len, H, Dk] at the last q_len positions of k: [s_len, Hkv, Dk], v: [s_len, Hkv, Dv]."""
    return sdpa_causal_heads_major(q, k.transpose(0, 1), v.transpose(0, 1), scale,
                                   sliding_window, softcap, sinks)


def sdpa_causal_heads_major(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [q_len, H, Dk] at the last q_len positions of k: [Hkv, s_len, Dk], v: [Hkv, s_len, Dv]
    -> [q_len, H, Dv]."""
    q_len, s_len = q.shape[0], k.shape[1]
    explicit = bool(softcap) or sinks is not None
    if q_len == s_len and not sliding_window and not explicit:
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            is_causal=True, scale=scale, enable_gqa=True,
        )  # [1, H, q_len, Dv]
        return o[0].transpose(0, 1)
    # The explicit path's scores are [H, rows, s_len]: a long chunk goes a slice of rows at a
    # time (SDPA needs no slicing, it never holds them all).
    rows = max(1, MAX_EXPLICIT_SCORES // (q.shape[1] * s_len)) if explicit else q_len
    out = q.new_empty(q_len, q.shape[1], v.shape[-1])
    k_pos = torch.arange(s_len, device=q.device).view(1, -1)
    for lo in range(0, q_len, rows):
        hi = min(q_len, lo + rows)
        q_pos = torch.arange(s_len - q_len + lo, s_len - q_len + hi, device=q.device).view(-1, 1)
        mask = k_pos <= q_pos  # [hi - lo, s_len]
        if sliding_window:
            mask &= k_pos > q_pos - sliding_window
        o = attention_heads_major(
            q[lo:hi].transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, scale,
            softcap=softcap, sinks=sinks,
        )  # [1, H, hi - lo, Dv]
        out[lo:hi] = o[0].transpose(0, 1)
    return out
