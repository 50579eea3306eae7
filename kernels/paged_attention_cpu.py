"""Fast CPU paged attention: short queries batched, shared prefixes attended once (cascade).

The n samples of one prompt (a GRPO group) and other prefix-cache hits point at the same
leading KV blocks. Their queries attend to that shared prefix together, gathered once,
and each request attends to its own remaining blocks; the two partial results are merged
with their log-sum-exps. This is the same math as `paged_attention_ref`, reordered.

Any [num_blocks, bs, Hkv, D] cache works; the engine stores its CPU cache heads-major
underneath (see `KVCacheSpec.storage_shape`), which makes every gather a single
contiguous `index_select` into the [Hkv, N, L, D] layout the matmuls want.

Where the compiled kernel (`kernels/cpu_extension.py`) is available, the short queries skip
the gathers altogether: the kernel reads the blocks in place with the same shared-prefix
groups (about 6x less attention time at a few hundred decode rows). Prefill chunks keep the
torch path, whose matmuls already run at the BLAS's speed.

A layer's sliding window (see `paged_attention_ref`) is honoured everywhere: the kernel and the
prefill chunks skip the blocks wholly outside it; the torch path for short queries masks them
and shares no prefix (a shared prefix may be partly outside a member's window).

So are a logit softcap, sinks and values of their own width (see `paged_attention_ref`). The
softcap bends each score before the mask, which keeps the cascade's merge exact. Sinks are one
more term of each row's softmax denominator: the torch path for short queries adds it once, at
the end, from the row's final log-sum-exp (out * sigmoid(lse - sink)); the kernel starts each
row's running softmax with it; prefill chunks take the reference's explicit path.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from kernels import cpu_extension
from kernels.attention_metadata import AttentionMetadata
from kernels.paged_attention_ref import (
    MAX_BATCHED_QUERY_LEN,
    sdpa_causal_heads_major,
    store_kv_cache_ref,
)

# Requests share a prefix worth attending once only if it spans at least this many blocks.
MIN_SHARED_BLOCKS = 2


@dataclass
class _Part:
    """One padded batched attention: rows [N, R] of the flat query, KV tables, a mask."""

    rows: torch.Tensor  # [N, R] flat query row per slot (padding -> row 0)
    valid: torch.Tensor  # [N, R] bool
    tables: torch.Tensor  # [N, num_blocks] int64
    mask: torch.Tensor  # [N, R, L] bool: which keys each query slot may see


def paged_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    use_kernel: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `paged_attention_ref`: query [T, H, Dk] -> [T, H, Dv].

    `use_kernel`: the compiled kernel for the short queries (None: wherever it is available,
    False: the torch path). The choice is made once per step and window, with its plan (the
    softcap and sinks change neither: every path takes them).
    """
    key = ("cpu_plan", sliding_window)
    plan = metadata.cache.get(key)
    if plan is None:
        if use_kernel is None:
            use_kernel = (_kernel_applies(query, key_cache, value_cache)
                          and cpu_extension.available())
        plan = metadata.cache[key] = _build_plan(metadata, use_kernel, sliding_window)
    softcap = softcap or None  # 0: none
    sinks = None if sinks is None else sinks.float()  # [H]
    out = query.new_empty(*query.shape[:2], value_cache.shape[-1])  # [T, H, Dv]
    if plan["kernel"] is not None:
        cpu_extension.paged_attention_short(
            query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, *plan["kernel"], scale, out, sliding_window, softcap,
            sinks,
        )
    elif plan["own"] is not None:
        o, lse = _attend(query, key_cache, value_cache, plan["own"], scale, softcap)
        if plan["shared"] is not None:
            o_shared, lse_shared = _attend(query, key_cache, value_cache, plan["shared"], scale,
                                           softcap)
            own_index = plan["own_index_of_shared"]  # each shared slot's own slot: unique
            o[own_index], lse[own_index] = _merge(o[own_index], lse[own_index], o_shared,
                                                  lse_shared)
        if sinks is not None:  # exp(lse) / (exp(lse) + exp(sink)): the sink's share taken off
            o *= torch.sigmoid(lse - sinks).unsqueeze(-1)
        out[plan["own"].rows[plan["own"].valid]] = o.to(out.dtype)
    block_size = key_cache.shape[1]
    for req, start, q_len, s_len in plan["single"]:
        # Blocks before the first query token's window are never read (a window is shifted
        # with its keys: only relative positions matter).
        first = max(0, s_len - q_len - sliding_window + 1) // block_size if sliding_window else 0
        table = metadata.block_tables[req, first : -(-s_len // block_size)].long()
        num_keys = s_len - first * block_size
        k = _gather_heads_major(key_cache, table)[:, :num_keys]  # [Hkv, num_keys, Dk]
        v = _gather_heads_major(value_cache, table)[:, :num_keys]  # [Hkv, num_keys, Dv]
        out[start : start + q_len] = sdpa_causal_heads_major(
            query[start : start + q_len], k, v, scale, sliding_window, softcap, sinks
        )
    return out


def store_kv_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`store_kv_cache_ref`, through the compiled kernel when it is built, else with a fast path
    for heads-major caches (see KVCacheSpec); key and value rows may differ in width (key
    [T, Hkv, Dk], value [T, Hkv, Dv])."""
    if (cpu_extension.available() and slot_mapping.dtype == torch.int64
            and key.dtype == key_cache.dtype and value.dtype == value_cache.dtype):
        return cpu_extension.store_kv(key, value, key_cache, value_cache, slot_mapping)
    key_heads_major = key_cache.permute(2, 0, 1, 3)  # [Hkv, num_blocks, bs, Dk]
    value_heads_major = value_cache.permute(2, 0, 1, 3)  # [Hkv, num_blocks, bs, Dv]
    if not (key_heads_major.is_contiguous() and value_heads_major.is_contiguous()):
        return store_kv_cache_ref(key, value, key_cache, value_cache, slot_mapping)
    num_kv_heads = key.shape[1]
    for cache, new in ((key_heads_major, key), (value_heads_major, value)):
        # [Hkv, num_slots, D] <- [Hkv, T, D]
        cache.view(num_kv_heads, -1, new.shape[-1]).index_copy_(1, slot_mapping,
                                                                 new.transpose(0, 1))


def _gather_heads_major(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Blocks `tables` ([N, nb] or [nb]) of a [num_blocks, bs, Hkv, D] cache as
    [Hkv, N * nb * bs, D]: one copy when the cache is stored heads-major."""
    flat = tables.reshape(-1)
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    heads_major = cache.permute(2, 0, 1, 3)  # [Hkv, num_blocks, bs, D]
    if heads_major.is_contiguous():
        return heads_major.index_select(1, flat).view(num_kv_heads, -1, head_dim)
    gathered = cache.index_select(0, flat)  # [N * nb, bs, Hkv, D]
    return gathered.view(-1, num_kv_heads, head_dim).transpose(0, 1).contiguous()


def _attend(query, key_cache, value_cache, part: _Part, scale: float,
            softcap: float | None = None):
    """Attention of part's query slots with log-sum-exp: ([V, H, Dv], [V, H]) for valid slots
    (no sinks: the caller adds them once its parts are merged)."""
    num, num_rows = part.rows.shape
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    value_dim = value_cache.shape[3]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    length = part.tables.shape[1] * block_size
    k = _gather_heads_major(key_cache, part.tables).view(num_kv_heads, num, length, head_dim)
    v = _gather_heads_major(value_cache, part.tables).view(num_kv_heads, num, length, value_dim)
    k, v = k.float(), v.float()
    q = query[part.rows].float()  # [N, R, H, Dk]
    # Heads h = kv * group + j share KV head kv: [Hkv, N, group * R, Dk]
    q = q.view(num, num_rows, num_kv_heads, group, head_dim).permute(2, 0, 3, 1, 4)
    q = q.reshape(num_kv_heads, num, group * num_rows, head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [Hkv, N, group * R, L]
    if softcap:  # before the mask, as Hugging Face does: masked keys stay at -inf
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores = scores.view(num_kv_heads, num, group, num_rows, length)
    scores.masked_fill_(~part.mask.view(1, num, 1, num_rows, length), float("-inf"))
    m = scores.amax(-1, keepdim=True)  # [Hkv, N, group, R, 1]
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    denom = p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    o = torch.matmul(p.view(num_kv_heads, num, group * num_rows, length), v)
    o = o.view(num_kv_heads, num, group, num_rows, value_dim) / denom
    lse = (m + denom.log()).squeeze(-1)  # [Hkv, N, group, R]
    # -> slots first: [N, R, H, Dv] and [N, R, H], then keep the valid slots.
    o = o.permute(1, 3, 0, 2, 4).reshape(num, num_rows, num_heads, value_dim)
    lse = lse.permute(1, 3, 0, 2).reshape(num, num_rows, num_heads)
    return o[part.valid], lse[part.valid]


def _merge(o_a, lse_a, o_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attentions over disjoint key sets: o [V, H, Dv], lse [V, H] -> the same."""
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    return (o_a * w_a[..., None] + o_b * w_b[..., None]) / total[..., None], m + total.log()


def _kernel_applies(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> bool:
    return (
        query.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and query.stride(-1) == 1
        and key_cache.stride(-1) == 1
        and value_cache.stride(-1) == 1
    )


def _build_plan(
    metadata: AttentionMetadata, use_kernel: bool = False, sliding_window: int | None = None
) -> dict:
    """Per step: which requests share prefixes, and the padded index tensors (or, for the
    compiled kernel, the groups as flat index tensors)."""
    q_lens, s_lens = metadata.query_lens_cpu, metadata.seq_lens_cpu
    tables = metadata.block_tables_cpu
    if tables is None:
        tables = [t[: -(-s // metadata.block_size)] for t, s in
                  zip(metadata.block_tables.tolist(), s_lens)]
    starts = metadata.query_start_loc.tolist()
    batched = [i for i, q in enumerate(q_lens) if q <= MAX_BATCHED_QUERY_LEN]
    single = [(i, starts[i], q, s_lens[i]) for i, q in enumerate(q_lens)
              if q > MAX_BATCHED_QUERY_LEN]
    plan = {"own": None, "shared": None, "own_index_of_shared": None, "single": single,
            "kernel": None}
    if not batched:
        return plan
    bs = metadata.block_size
    groups = _shared_prefix_groups(batched, tables, q_lens, s_lens, bs)
    if use_kernel:
        plan["kernel"] = _kernel_groups(batched, groups)
        return plan
    if sliding_window:
        groups = []
    num_shared = {i: c for members, c in groups for i in members}
    plan["own"] = _own_part(batched, tables, q_lens, s_lens, starts, num_shared, bs,
                            sliding_window)
    if groups:
        plan["shared"] = _shared_part(groups, tables, q_lens, starts, bs)
        # Position of each shared slot's row among the own part's valid slots.
        own_rows = plan["own"].rows[plan["own"].valid].tolist()
        where = {row: k for k, row in enumerate(own_rows)}
        shared_rows = plan["shared"].rows[plan["shared"].valid].tolist()
        plan["own_index_of_shared"] = torch.tensor([where[r] for r in shared_rows])
    return plan


def _shared_prefix_groups(batched, tables, q_lens, s_lens, bs) -> list[tuple[list[int], int]]:
    """Groups of >= 2 requests whose leading blocks are the same, with the shared count.

    Only blocks wholly before every member's first query position count, so no member
    needs a causal mask inside the shared prefix.
    """
    by_first_block: dict[int, list[int]] = defaultdict(list)
    for i in batched:
        if len(tables[i]) >= MIN_SHARED_BLOCKS:
            by_first_block[tables[i][0]].append(i)
    groups = []
    for members in by_first_block.values():
        if len(members) < 2:
            continue
        limit = min((s_lens[i] - q_lens[i]) // bs for i in members)
        first = tables[members[0]]
        num_shared = 0
        while num_shared < limit and all(
            len(tables[i]) > num_shared and tables[i][num_shared] == first[num_shared]
            for i in members
        ):
            num_shared += 1
        if num_shared >= MIN_SHARED_BLOCKS:
            groups.append((members, num_shared))
    return groups


def _kernel_groups(batched, groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(members, group_starts, group_shared) for the compiled kernel: the sharing groups,
    then every other batched request as a group of one that shares nothing."""
    grouped = {i for members, _ in groups for i in members}
    groups = groups + [([i], 0) for i in batched if i not in grouped]
    members = [i for group, _ in groups for i in group]
    starts = [0]
    for group, _ in groups:
        starts.append(starts[-1] + len(group))
    return torch.tensor(members), torch.tensor(starts), torch.tensor([c for _, c in groups])


def _own_part(batched, tables, q_lens, s_lens, starts, num_shared, bs, sliding_window) -> _Part:
    """Each request's queries over its blocks past the shared prefix (causal, and within the
    sliding window if there is one)."""
    own_tables = [tables[i][num_shared.get(i, 0) : -(-s_lens[i] // bs)] for i in batched]
    max_rows = max(q_lens[i] for i in batched)
    num_blocks = max(len(t) for t in own_tables)
    rows = torch.zeros(len(batched), max_rows, dtype=torch.int64)
    table_t = torch.zeros(len(batched), num_blocks, dtype=torch.int64)
    for b, i in enumerate(batched):
        rows[b, : q_lens[i]] = torch.arange(starts[i], starts[i] + q_lens[i])
        table_t[b, : len(own_tables[b])] = torch.tensor(own_tables[b])
    q_len_t = torch.tensor([q_lens[i] for i in batched]).view(-1, 1)
    s_len_t = torch.tensor([s_lens[i] for i in batched]).view(-1, 1, 1)
    first_key = torch.tensor([num_shared.get(i, 0) * bs for i in batched]).view(-1, 1, 1)
    q_pos = (s_len_t.view(-1, 1) - q_len_t + torch.arange(max_rows)).unsqueeze(-1)  # [N, R, 1]
    k_pos = first_key + torch.arange(num_blocks * bs).view(1, 1, -1)  # [N, 1, L]
    mask = (k_pos <= q_pos) & (k_pos < s_len_t)
    if sliding_window:
        mask &= k_pos > q_pos - sliding_window
    valid = torch.arange(max_rows).view(1, -1) < q_len_t
    return _Part(rows, valid, table_t, mask)


def _shared_part(groups, tables, q_lens, starts, bs) -> _Part:
    """All members' queries of each group over the group's shared blocks (no mask needed)."""
    max_rows = max(sum(q_lens[i] for i in members) for members, _ in groups)
    num_blocks = max(c for _, c in groups)
    rows = torch.zeros(len(groups), max_rows, dtype=torch.int64)
    valid = torch.zeros(len(groups), max_rows, dtype=torch.bool)
    table_t = torch.zeros(len(groups), num_blocks, dtype=torch.int64)
    lengths = torch.zeros(len(groups), 1, 1, dtype=torch.int64)
    for g, (members, c) in enumerate(groups):
        member_rows = [r for i in members for r in range(starts[i], starts[i] + q_lens[i])]
        rows[g, : len(member_rows)] = torch.tensor(member_rows)
        valid[g, : len(member_rows)] = True
        table_t[g, :c] = torch.tensor(tables[members[0]][:c])
        lengths[g] = c * bs
    mask = torch.arange(num_blocks * bs).view(1, 1, -1) < lengths  # [G, 1, L]
    return _Part(rows, valid, table_t, mask.expand(-1, max_rows, -1))
