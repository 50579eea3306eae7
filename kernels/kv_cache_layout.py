"""How each backend lays out the paged KV cache in memory; everyone else sees one logical shape."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheLayout:
    """The memory order of the KV cache for one backend.

    The model and the kernels always see the logical shape
    [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]. Heads-major storage
    ([num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]) lets the CPU attention
    gather a batch's blocks straight into [Hkv, N, L, D] in one copy; the Triton kernels read
    block-major storage.
    """

    heads_major: bool

    def storage_shape(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        if self.heads_major:
            return (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)
        return (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)

    def logical_view(self, storage: torch.Tensor) -> torch.Tensor:
        """[L, 2, num_blocks, bs, Hkv, D], a view of `storage` whatever its order."""
        return storage.permute(0, 1, 3, 4, 2, 5) if self.heads_major else storage

    def cache_storage_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """One layer's key (or value) cache in memory order."""
        if self.heads_major:
            return (num_kv_heads, num_blocks, block_size, head_dim)
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def cache_logical_view(self, storage: torch.Tensor) -> torch.Tensor:
        """[num_blocks, bs, Hkv, D], a view of one layer's `storage` whatever its order."""
        return storage.permute(1, 2, 0, 3) if self.heads_major else storage


def kv_cache_layout(device: torch.device) -> KVCacheLayout:
    """The layout the kernels for `device` read fastest: heads-major on CPU, block-major on CUDA."""
    return KVCacheLayout(heads_major=device.type == "cpu")
