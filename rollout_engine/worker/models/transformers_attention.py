"""Our paged attention as a transformers attention function, and the per-step context it reads.

transformers calls the function registered under `ATTENTION_NAME` once per layer, with q/k/v
after RoPE. The step's KV cache and metadata reach it through a per-thread context
(`running(step)`), not through kwargs: some models drop extra kwargs on the way to attention.
The context is scoped to one forward and per thread (the engine may run the forward on a
worker thread). In the load probe (a step without a KV cache) the function records each
call instead, for `TransformersForCausalLM.check_runs`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import AttentionMetadata, paged_attention, store_kv_cache

ATTENTION_NAME = "rollout_engine_paged"
"""Our attention's name in transformers' `AttentionInterface` (the `attn_implementation`)."""

_UNSUPPORTED_ATTENTION_KWARGS = ("s_aux", "sinks", "position_bias")
"""Attention-function kwargs that change the result in ways our kernels do not compute."""


@dataclass(frozen=True)
class AttentionCall:
    """What the load probe saw of one call of the attention function."""

    layer_idx: int | None
    num_kv_heads: int
    key_head_dim: int
    value_head_dim: int
    sliding_window: int | None
    unsupported: tuple[str, ...]
    """Arguments asking for something our kernels do not compute (a mask, softcapping...)."""


@dataclass
class AttentionStep:
    """What the attention function of every layer needs in one forward."""

    sliding_windows: list[int | None]
    """Per layer, as the mask transformers would build (None: full causal attention)."""
    kv_caches: torch.Tensor | None = None
    """[L, 2, num_blocks, block_size, Hkv, D]; None in the load probe."""
    metadata: AttentionMetadata | None = None
    probe_calls: list[AttentionCall] = field(default_factory=list)
    """The load probe's record: one entry per call."""


_current = threading.local()
"""`.step`: the forward running on this thread (the engine may run it on a worker thread)."""


@contextlib.contextmanager
def running(step: AttentionStep) -> Iterator[None]:
    """Make `step` the one this thread's attention calls read, for the `with` block."""
    previous = getattr(_current, "step", None)
    _current.step = step
    try:
        yield
    finally:
        _current.step = previous


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (see its `sdpa_attention_forward`): query
    [1, H, T, D], key / value [1, Hkv, T, D], after RoPE -> ([1, T, H, D], no weights)."""
    step: AttentionStep | None = getattr(_current, "step", None)
    if step is None:
        raise RuntimeError(
            f"the {ATTENTION_NAME!r} attention runs only inside TransformersForCausalLM.forward"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5  # sdpa's default
    if step.kv_caches is None:
        return _probe_attention(step, module, query, key, value, attention_mask, scale,
                                sliding_window, softcap, kwargs)
    layer_idx = module.layer_idx
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1).contiguous()  # [T, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()  # [T, Hkv, D]
    key_cache, value_cache = step.kv_caches[layer_idx]  # [num_blocks, bs, Hkv, D] each
    store_kv_cache(k, v, key_cache, value_cache, step.metadata.slot_mapping)
    out = paged_attention(q, key_cache, value_cache, step.metadata, scale,
                          step.sliding_windows[layer_idx])  # [T, H, D]
    return out[None], None


def _probe_attention(
    step: AttentionStep, module: nn.Module,
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scale: float, sliding_window: int | None,
    softcap: float | None, kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Record the call; attend with torch's sdpa (one causal sequence, no cache)."""
    unsupported = [name for name in _UNSUPPORTED_ATTENTION_KWARGS if kwargs.get(name) is not None]
    if attention_mask is not None:
        unsupported.append("attention_mask")
    if softcap is not None:
        unsupported.append("softcap")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        unsupported.append("is_causal=False")
    step.probe_calls.append(AttentionCall(
        getattr(module, "layer_idx", None), key.shape[1], key.shape[-1], value.shape[-1],
        sliding_window, tuple(unsupported),
    ))
    group = query.shape[1] // key.shape[1]  # query heads per KV head
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
    return out.transpose(1, 2), None  # [1, T, H, Dv]


def register_attention() -> None:
    """Make `ATTENTION_NAME` an attention implementation transformers knows (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
