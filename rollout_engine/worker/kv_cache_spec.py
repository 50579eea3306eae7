"""Size of the paged KV cache: bytes per block, and how many blocks the cache config asks for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import KVCacheLayout
from rollout_engine.config import CacheConfig
from rollout_engine.worker.models.decoder import head_dim_of


@dataclass(frozen=True)
class KVCacheSpec:
    """One model's KV cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model(cls, hf_config, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(
            hf_config.num_hidden_layers, block_size, hf_config.num_key_value_heads,
            head_dim_of(hf_config), dtype,
        )

    @property
    def block_nbytes(self) -> int:
        return (
            2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
            * self.dtype.itemsize
        )

    def num_blocks_for(self, cache_config: CacheConfig) -> int:
        if cache_config.num_blocks is not None:
            return cache_config.num_blocks
        return max(1, cache_config.kv_cache_bytes // self.block_nbytes)

    def storage_shape(self, layout: KVCacheLayout, num_blocks: int) -> tuple[int, ...]:
        return layout.storage_shape(
            self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        )
