"""Tensor-parallel sharding math: which slice of each full checkpoint tensor a rank holds.

Megatron's split: q/k/v and gate/up are split by output rows (column parallel), o_proj and
down_proj by input columns (row parallel), the embedding and lm_head by vocabulary rows.
Heads are never cut: a rank holds whole query heads and whole KV heads. When there are fewer
KV heads than ranks, each KV head is replicated on `tp_size // num_kv_heads` ranks (the ranks
whose query heads read it), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter relates to the full checkpoint tensor of the same name.

    `dim` None means the rank holds the whole tensor (replicated). Otherwise it holds
    `[start, start + size)` along `dim`; a local parameter longer than `size` along `dim`
    (the last vocabulary shard) is zero-padded.
    """

    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    size: int = 0

    @property
    def is_sharded(self) -> bool:
        return self.dim is not None

    def select(self, full: Any) -> torch.Tensor:
        """This rank's slice of `full` (a tensor, or a safetensors slice read lazily)."""
        if self.dim is None:
            return full[:]
        index = (slice(None),) * self.dim + (slice(self.start, self.start + self.size),)
        return full[index]

    def copy_into(self, param: torch.Tensor, full: Any) -> None:
        """Write this rank's slice of `full` into `param`, zero-filling the padding."""
        local = self.select(full)
        if self.dim is None or self.size == param.shape[self.dim]:
            param.copy_(local)
            return
        param.narrow(self.dim, 0, self.size).copy_(local)
        param.narrow(self.dim, self.size, param.shape[self.dim] - self.size).zero_()


def split_evenly(total: int, tp_size: int, rank: int, what: str) -> tuple[int, int]:
    """(start, size) of rank's equal part of `total`; ValueError unless tp_size divides it."""
    if total % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide {what} ({total}); choose a "
            f"tensor_parallel_size that divides it"
        )
    size = total // tp_size
    return rank * size, size


def kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first KV head, number of KV heads) that rank holds, replicated when they are fewer
    than the ranks."""
    if num_kv_heads >= tp_size:
        return split_evenly(num_kv_heads, tp_size, rank, "num_key_value_heads")
    if tp_size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) is smaller than tensor_parallel_size "
            f"({tp_size}) and does not divide it, so KV heads cannot be replicated evenly; "
            f"choose a tensor_parallel_size that is a multiple or a divisor of {num_kv_heads}"
        )
    return rank // (tp_size // num_kv_heads), 1


@dataclass(frozen=True)
class VocabShard:
    """Rows [start, start + size) of the vocabulary, in a local table of `num_rows` rows
    (every rank's table has the same length; the last one's tail is padding)."""

    start: int
    size: int
    num_rows: int


def vocab_shard(vocab_size: int, tp_size: int, rank: int) -> VocabShard:
    """Rank's part of the vocabulary: ceil(vocab_size / tp_size) rows, the last rank fewer."""
    num_rows = -(-vocab_size // tp_size)
    start = min(rank * num_rows, vocab_size)
    return VocabShard(start, min(num_rows, vocab_size - start), num_rows)


@dataclass(frozen=True)
class AttentionShard:
    """The heads one rank computes: query heads [q_start, q_start + num_heads) and KV heads
    [kv_start, kv_start + num_kv_heads)."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def attention_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> AttentionShard:
    q_start, num_local_heads = split_evenly(num_heads, tp_size, rank, "num_attention_heads")
    kv_start, num_local_kv_heads = kv_head_range(num_kv_heads, tp_size, rank)
    return AttentionShard(q_start, num_local_heads, kv_start, num_local_kv_heads)


def check_tensor_parallel(hf_config, tp_size: int) -> None:
    """ValueError saying what to change unless the model splits over `tp_size` ranks."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    attention_shard(hf_config.num_attention_heads, hf_config.num_key_value_heads, tp_size, 0)
    split_evenly(hf_config.intermediate_size, tp_size, 0, "intermediate_size")
    if hf_config.vocab_size < tp_size:
        raise ValueError(
            f"vocab_size ({hf_config.vocab_size}) is smaller than tensor_parallel_size "
            f"({tp_size}); use fewer ranks"
        )


def num_local_kv_heads(hf_config, tp_size: int, rank: int = 0) -> int:
    """KV heads in one rank's KV cache (the same on every rank)."""
    return kv_head_range(hf_config.num_key_value_heads, tp_size, rank)[1]
