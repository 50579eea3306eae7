"""Random paged-attention batches and a naive per-token oracle, shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import AttentionMetadata

# Tolerance of a kernel's output against the float64 oracle, per input dtype.
ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class AttentionCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, value_head_dim]
    metadata: AttentionMetadata
    scale: float
    sliding_window: int | None = None
    """A layer's window: each token sees its own key and the window - 1 before it."""
    softcap: float | None = None
    """Logit softcap c (Gemma 2): scores s become c * tanh(s / c) before the mask."""
    sinks: torch.Tensor | None = None
    """[num_heads] float32 (gpt-oss): one extra logit per head whose value is zero."""

    @property
    def options(self) -> dict:
        """The layer's attention options, as keyword arguments of `paged_attention`."""
        return {"sliding_window": self.sliding_window, "softcap": self.softcap,
                "sinks": self.sinks}

    @property
    def output_shape(self) -> tuple[int, int, int]:
        """[num_tokens, num_heads, value_head_dim]."""
        return (*self.query.shape[:2], self.value_cache.shape[-1])

    def cast(self, dtype: torch.dtype) -> AttentionCase:
        """The inputs in `dtype`; the options (sinks included, float32) kept as they are."""
        return AttentionCase(self.query.to(dtype), self.key_cache.to(dtype),
                             self.value_cache.to(dtype), self.metadata, self.scale,
                             self.sliding_window, self.softcap, self.sinks)


def random_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, generator: torch.Generator
) -> list[list[int]]:
    """Distinct, shuffled block ids per request (never in position order)."""
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables, next_free = [], 0
    for seq_len in seq_lens:
        num_needed = -(-seq_len // block_size)
        tables.append(perm[next_free : next_free + num_needed])
        next_free += num_needed
    return tables


def make_case(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    num_spare_blocks: int = 3,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    sliding_window: int | None = None,
    value_head_dim: int | None = None,
    softcap: float | None = None,
    sinks: bool = False,
) -> AttentionCase:
    """A batch whose cache is random everywhere, so reading a wrong slot changes the result.

    `value_head_dim`: values of their own width (None: head_dim); `sinks`: one random logit
    per query head (randn * 2, so some outweigh the keys and some hardly count)."""
    assert all(0 < q <= s for q, s in zip(query_lens, seq_lens)), (query_lens, seq_lens)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + num_spare_blocks
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=device)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, value_head_dim or head_dim,
                              generator=gen)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    # Drawn last, so that a case without sinks keeps the inputs it always had.
    sink_logits = torch.randn(num_heads, generator=gen) * 2 if sinks else None
    to = {"dtype": dtype, "device": device}
    return AttentionCase(
        query.to(**to), key_cache.to(**to), value_cache.to(**to), metadata, head_dim**-0.5,
        sliding_window, softcap, None if sink_logits is None else sink_logits.to(device),
    )


def naive_attention(case: AttentionCase) -> torch.Tensor:
    """Float64 attention, one query token at a time, K/V read slot by slot: [T, H, Dv].

    As Hugging Face computes it: scores scaled, softcapped (c * tanh(s / c)), masked (causal,
    sliding window), a sink column appended per head, softmax, the sink column dropped."""
    window, softcap = case.sliding_window, case.softcap
    sinks = None if case.sinks is None else case.sinks.cpu().double().view(-1, 1)  # [H, 1]
    md = case.metadata
    query = case.query.cpu().double()
    key_cache, value_cache = case.key_cache.cpu().double(), case.value_cache.cpu().double()
    block_size = key_cache.shape[1]
    group = query.shape[1] // key_cache.shape[2]
    tables = md.block_tables.cpu().tolist()
    out = query.new_zeros(*query.shape[:2], value_cache.shape[-1])
    token = 0
    for table, q_len, s_len in zip(tables, md.query_lens_cpu, md.seq_lens_cpu):
        blocks = [table[p // block_size] for p in range(s_len)]
        offsets = [p % block_size for p in range(s_len)]
        k = key_cache[blocks, offsets].repeat_interleave(group, dim=1)  # [s_len, H, D]
        v = value_cache[blocks, offsets].repeat_interleave(group, dim=1)
        for i in range(q_len):
            end = s_len - q_len + i + 1  # the token's own position and everything before
            begin = max(0, end - window) if window else 0  # within its window
            scores = torch.einsum("hd,phd->hp", query[token], k[begin:end]) * case.scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:
                probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[:, :-1]
            else:
                probs = scores.softmax(-1)
            out[token] = torch.einsum("hp,phd->hd", probs, v[begin:end])
            token += 1
    return out


def naive_store(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The KV store, one token at a time."""
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        key_cache[slot // block_size, slot % block_size] = key[token]
        value_cache[slot // block_size, slot % block_size] = value[token]


# Named batch shapes: (query_lens, seq_lens, keyword overrides of make_case).
CASES: dict[str, tuple[list[int], list[int], dict]] = {
    # Decode rows, a 1-token prompt, spec-verify rows and a prefill chunk with context.
    "mixed": ([1, 1, 5, 20, 3], [9, 1, 5, 37, 16], {}),
    # Block edges (block_size 4): full blocks, a query crossing an edge, a decode row on
    # the first slot of a new block, one on the last slot of a block.
    "block_edges": ([8, 3, 1, 1, 17], [8, 6, 9, 12, 24], {}),
    # Long decode contexts, GQA group 4.
    "long_decode": ([1, 1, 1], [70, 45, 64], {"num_heads": 8, "num_kv_heads": 2}),
    # MHA, odd head_dim, block_size 5 (not a power of 2).
    "mha_odd": ([2, 19], [11, 23], {"num_heads": 2, "num_kv_heads": 2, "head_dim": 24,
                                    "block_size": 5}),
    # Group of 3 query heads per KV head (tile rows do not divide evenly); a whole
    # 18-token prompt (the unbatched causal path).
    "group3": ([1, 6, 18], [30, 6, 18], {"num_heads": 6, "num_kv_heads": 2, "block_size": 8}),
}


# Windows for the named cases: one token, shorter than a block, a block edge (block_size 4),
# inside the longest prompts, and longer than every sequence (then it changes nothing).
SLIDING_WINDOWS = [1, 3, 4, 9, 100]


# make_case options of each attention feature: a logit softcap (Gemma 2), attention sinks
# (gpt-oss), values narrower or wider than the keys (multi-head latent attention), and all of
# them together with a sliding window. The softcap is small enough to bend typical scores.
FEATURES: dict[str, dict] = {
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": True},
    "value_dim": {"value_head_dim": 12},
    "all": {"softcap": 2.0, "sinks": True, "value_head_dim": 40, "sliding_window": 9},
}


def make_named_case(name: str, **overrides) -> AttentionCase:
    query_lens, seq_lens, options = CASES[name]
    return make_case(query_lens, seq_lens, **{**options, **overrides})
