"""Chooses the kernel for a tensor's device: Triton on CUDA, the batched torch path elsewhere."""

from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.paged_attention_cpu import paged_attention_cpu, store_kv_cache_cpu


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V ([num_tokens, num_kv_heads, head_dim]) into the paged cache."""
    if _use_triton(key):
        from kernels.triton_kv_store import store_kv_cache_triton

        return store_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    return store_kv_cache_cpu(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention over the paged KV cache; query [num_tokens, num_heads, head_dim]."""
    if _use_triton(query):
        from kernels.triton_paged_attention import paged_attention_triton

        return paged_attention_triton(query, key_cache, value_cache, metadata, scale)
    return paged_attention_cpu(query, key_cache, value_cache, metadata, scale)
