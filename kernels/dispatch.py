"""Chooses the kernel for a tensor's device: Triton on CUDA, the batched torch path on the CPU,
the torch reference anywhere else (or on CUDA when Triton is switched off); the batch-invariant
kernel, in any case, in a thread inside `batch_invariant_attention()`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.paged_attention_cpu import paged_attention_cpu, store_kv_cache_cpu
from kernels.paged_attention_ref import paged_attention_ref, store_kv_cache_ref
from kernels.triton_utils import batch_invariant_runs_triton


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def attention_backend(device: torch.device, use_triton: bool = True) -> str:
    """"triton", "cpu" (the batched fast path, whose plans are built on the host) or
    "reference" (every index built on the tensors' device)."""
    if device.type == "cuda" and use_triton:
        return "triton"
    return "cpu" if device.type == "cpu" else "reference"


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on `t`'s GPU whatever the calling thread's current device (`--device cuda:1`)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K ([num_tokens, num_kv_heads, head_dim]) and V ([num_tokens, num_kv_heads,
    value_head_dim]) into the paged caches ([num_blocks, block_size, num_kv_heads, *])."""
    backend = attention_backend(key.device, _use_triton(key))
    if backend == "triton":
        from kernels.triton_kv_store import store_kv_cache_triton

        with _on_device(key):
            return store_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    store: Callable = store_kv_cache_cpu if backend == "cpu" else store_kv_cache_ref
    return store(key, value, key_cache, value_cache, slot_mapping)


_invariant = threading.local()


@contextlib.contextmanager
def batch_invariant_attention() -> Iterator[None]:
    """In this thread, `paged_attention` runs the batch-invariant kernel (each token's bits
    fixed by its own keys; `rollout_engine.batch_invariant`)."""
    _invariant.depth = getattr(_invariant, "depth", 0) + 1
    try:
        yield
    finally:
        _invariant.depth -= 1


def _paged_attention_batch_invariant(query, key_cache, value_cache, metadata, scale,
                                     sliding_window, softcap, sinks) -> torch.Tensor:
    from kernels import cpu_extension

    if batch_invariant_runs_triton(query):
        from kernels import triton_batch_invariant

        with _on_device(query):
            return triton_batch_invariant.paged_attention(
                query, key_cache, value_cache, metadata, scale, sliding_window, softcap, sinks)
    if query.device.type != "cpu" or not cpu_extension.available():
        raise RuntimeError("batch-invariant attention runs on the CPU with the compiled kernels "
                           "or on CUDA with Triton")
    if softcap or sinks is not None:
        raise NotImplementedError("batch-invariant attention has no softcap or sinks yet")
    return cpu_extension.batch_invariant_paged_attention(
        query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
        metadata.query_start_loc, scale, sliding_window or 0)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over the paged KV cache: query [num_tokens, num_heads, head_dim] ->
    [num_tokens, num_heads, value_head_dim] (the value cache's last dim, which may differ from
    the keys', as in multi-head latent attention).

    A layer's settings, as Hugging Face computes them: `sliding_window` W, each token sees its
    own key and the W - 1 before it only (None sees everything before it); `softcap` c (Gemma
    2), scores s become c * tanh(s / c) before the mask (None or 0: none); `sinks` ([num_heads],
    gpt-oss), one more logit per head in the softmax, with a zero value."""
    if getattr(_invariant, "depth", 0):
        return _paged_attention_batch_invariant(query, key_cache, value_cache, metadata, scale,
                                                sliding_window, softcap, sinks)
    backend = attention_backend(query.device, _use_triton(query))
    if backend == "triton":
        from kernels.triton_paged_attention import paged_attention_triton

        with _on_device(query):
            return paged_attention_triton(
                query, key_cache, value_cache, metadata, scale, sliding_window, softcap, sinks
            )
    if backend == "cpu":
        return paged_attention_cpu(query, key_cache, value_cache, metadata, scale,
                                   sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    return paged_attention_ref(query, key_cache, value_cache, metadata, scale, sliding_window,
                               softcap, sinks)
