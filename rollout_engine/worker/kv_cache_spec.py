"""Size of the paged KV cache: bytes per block, and how many blocks fit the budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import KVCacheLayout
from rollout_engine.config import CacheConfig
from rollout_engine.worker.models.decoder import head_dim_of
from rollout_engine.worker.models.tp_sharding import num_local_kv_heads


@dataclass(frozen=True)
class KVCacheSpec:
    """One model's KV cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model(
        cls, hf_config, block_size: int, dtype: torch.dtype, tp_size: int = 1
    ) -> KVCacheSpec:
        """One rank's KV cache: with tensor parallelism it holds only that rank's KV heads."""
        return cls(
            hf_config.num_hidden_layers, block_size, num_local_kv_heads(hf_config, tp_size),
            head_dim_of(hf_config), dtype,
        )

    @property
    def block_nbytes(self) -> int:
        return (
            2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
            * self.dtype.itemsize
        )

    def num_blocks_for(self, cache_config: CacheConfig, kv_cache_bytes: int) -> int:
        """`num_blocks` if set, else as many blocks as `kv_cache_bytes` holds."""
        if cache_config.num_blocks is not None:
            return cache_config.num_blocks
        return max(1, kv_cache_bytes // self.block_nbytes)

    def storage_shape(self, layout: KVCacheLayout, num_blocks: int) -> tuple[int, ...]:
        return layout.storage_shape(
            self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        )


DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024**2


def plan_kv_cache_bytes(
    total_bytes: int, free_bytes: int, engine_bytes: int, activation_bytes: int,
    utilization: float,
) -> int:
    """KV bytes on a GPU: the engine may use `utilization` of the device in all, of which its
    weights (`engine_bytes`, already allocated) and the activations of the largest step take
    their share; never more than is free now, leaving room for those activations."""
    budget = int(utilization * total_bytes) - engine_bytes - activation_bytes
    budget = min(budget, free_bytes - activation_bytes)
    if budget <= 0:
        raise ValueError(
            f"no room for a KV cache: gpu_memory_utilization={utilization} of "
            f"{total_bytes / 2**30:.1f} GiB is {utilization * total_bytes / 2**30:.2f} GiB, the "
            f"weights take {engine_bytes / 2**30:.2f} GiB and activations about "
            f"{activation_bytes / 2**30:.2f} GiB ({free_bytes / 2**30:.2f} GiB free now); raise "
            "gpu_memory_utilization, free device memory, or set kv_cache_bytes"
        )
    return budget


def activation_bytes_estimate(hf_config, max_num_batched_tokens: int, max_num_seqs: int,
                              dtype: torch.dtype) -> int:
    """A generous bound on one step's transient memory: per-token hidden and MLP activations,
    plus fp32 logits and their softmax for every sampled row (drafts included). A config
    without `intermediate_size` (GPT-2, OPT) is taken to have the usual 4 x hidden."""
    hidden = hf_config.hidden_size
    intermediate = getattr(hf_config, "intermediate_size", None) or 4 * hidden
    per_token = (8 * hidden + 3 * intermediate) * dtype.itemsize
    logits = 3 * max_num_seqs * 8 * hf_config.vocab_size * 4
    return max_num_batched_tokens * per_token + logits
