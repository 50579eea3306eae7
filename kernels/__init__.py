"""Attention and KV-cache kernels: Triton on CUDA, a torch reference everywhere else."""

from kernels.attention_metadata import AttentionMetadata
from kernels.dispatch import paged_attention, store_kv_cache

__all__ = ["AttentionMetadata", "paged_attention", "store_kv_cache"]
