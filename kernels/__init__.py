"""Attention and KV-cache kernels: Triton on CUDA, a torch reference everywhere else."""

from kernels.attention_metadata import AttentionMetadata
from kernels.dispatch import paged_attention, store_kv_cache
from kernels.kv_cache_layout import KVCacheLayout, kv_cache_layout

__all__ = [
    "AttentionMetadata",
    "KVCacheLayout",
    "kv_cache_layout",
    "paged_attention",
    "store_kv_cache",
]
