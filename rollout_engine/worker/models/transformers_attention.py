"""Our paged attention as a transformers attention function, and the per-step context it reads.

transformers calls the function registered under `ATTENTION_NAME` once per layer, with q/k/v
after RoPE. The step's KV cache and metadata reach it through a per-thread context
(`running(step)`), not through kwargs: some models drop extra kwargs on the way to attention.
The context is scoped to one forward and per thread (the engine may run the forward on a
worker thread). In the load probe (a step without a KV cache) the function records each
call instead, for `TransformersForCausalLM.check_runs`, and attends exactly as HF's eager
attention would, so that the probe's forward is the model's.

Per layer it honours what our kernels compute: K and V head dims of their own (multi-head
latent attention), a sliding window, logit softcapping (`softcap`, Gemma 2) and attention
sinks (`s_aux`, gpt-oss: one extra softmax logit per query head), and KV shared with an
earlier layer (Gemma 3n: the layer gets that layer's K/V tensors and stores nothing).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kernels import AttentionMetadata, paged_attention, store_kv_cache
from kernels.paged_attention_ref import attention_heads_major

if TYPE_CHECKING:
    from rollout_engine.worker.kv_cache_spec import LayerKVSpec, PagedKVCache

ATTENTION_NAME = "rollout_engine_paged"
"""Our attention's name in transformers' `AttentionInterface` (the `attn_implementation`)."""

_SINK_KWARGS = ("s_aux", "sinks")
"""Names under which models pass attention sinks ([num_heads] logits)."""
_UNSUPPORTED_ATTENTION_KWARGS = ("position_bias", "attention_bias", "alibi")
"""Attention-function kwargs that change the result in ways our kernels do not compute."""


@dataclass
class AttentionCall:
    """What the load probe saw of one call of the attention function."""

    layer_idx: int | None
    key: torch.Tensor
    """[1, Hkv, T, Dk]: kept alive, so that a later layer given the same tensor (shared KV)
    is told apart from one whose tensor merely reuses freed memory."""
    value: torch.Tensor
    sliding_window: int | None
    unsupported: tuple[str, ...]
    """Arguments asking for something our kernels do not compute (a mask, ALiBi...)."""

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[1]

    @property
    def key_head_dim(self) -> int:
        return self.key.shape[-1]

    @property
    def value_head_dim(self) -> int:
        return self.value.shape[-1]


@dataclass
class AttentionStep:
    """What the attention function of every layer needs in one forward."""

    sliding_windows: Sequence[int | None]
    """Per layer, as the mask transformers would build (None: full causal attention)."""
    layers: Sequence[LayerKVSpec] | None = None
    """Per layer its KV (sizes, window, KV source); None in the load probe."""
    kv_caches: PagedKVCache | None = None
    """Per layer (key_cache, value_cache); None in the load probe."""
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
    [1, H, T, Dk], key [1, Hkv, T, Dk], value [1, Hkv, T, Dv], after RoPE ->
    ([1, T, H, Dv], no weights)."""
    step: AttentionStep | None = getattr(_current, "step", None)
    if step is None:
        raise RuntimeError(
            f"the {ATTENTION_NAME!r} attention runs only inside TransformersForCausalLM.forward"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5  # sdpa's default
    sinks = _sinks(kwargs)
    if step.kv_caches is None:
        return _probe_attention(step, module, query, key, value, attention_mask, scale,
                                sliding_window, softcap, sinks, kwargs)
    layer_idx = module.layer_idx
    layer = step.layers[layer_idx]
    q = query[0].transpose(0, 1)  # [T, H, Dk]
    key_cache, value_cache = step.kv_caches[layer_idx]  # [num_blocks, bs, Hkv, Dk / Dv]
    if layer.owns_kv:  # a layer sharing another's KV gets that layer's K/V: stored already
        k = key[0].transpose(0, 1)  # [T, Hkv, Dk]
        v = value[0].transpose(0, 1)  # [T, Hkv, Dv]
        store_kv_cache(k, v, key_cache, value_cache, step.metadata.slot_mapping)
    out = paged_attention(q.contiguous(), key_cache, value_cache, step.metadata, scale,
                          layer.sliding_window, softcap=softcap, sinks=sinks)  # [T, H, Dv]
    return out[None], None


def _sinks(kwargs: dict[str, Any]) -> torch.Tensor | None:
    for name in _SINK_KWARGS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def _probe_attention(
    step: AttentionStep, module: nn.Module,
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scale: float, sliding_window: int | None,
    softcap: float | None, sinks: torch.Tensor | None, kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Record the call; attend as HF's eager attention does (one causal sequence, no cache)."""
    unsupported = [name for name in _UNSUPPORTED_ATTENTION_KWARGS if kwargs.get(name) is not None]
    if attention_mask is not None:
        unsupported.append("attention_mask")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        unsupported.append("is_causal=False")
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        unsupported.append(f"sinks of shape {tuple(sinks.shape)}")
    layer_idx = getattr(module, "layer_idx", None)
    step.probe_calls.append(AttentionCall(layer_idx, key, value, sliding_window,
                                          tuple(unsupported)))
    window = step.sliding_windows[layer_idx] if layer_idx is not None else None
    out = eager_attention(query[0].float(), key[0].float(), value[0].float(), scale, window,
                          softcap, sinks)
    return out.to(query.dtype).transpose(0, 1).contiguous()[None], None  # [1, T, H, Dv]


def eager_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
    sliding_window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence with no cache: query [H, T, Dk], key [Hkv, T, Dk],
    value [Hkv, T, Dv] -> [H, T, Dv] (the kernels' reference math)."""
    positions = torch.arange(query.shape[1], device=query.device)
    visible = positions[None, :] <= positions[:, None]  # [T, T]
    if sliding_window:
        visible &= positions[None, :] > positions[:, None] - sliding_window
    out = attention_heads_major(query[None], key[None], value[None], visible, scale,
                                softcap=softcap, sinks=sinks)
    return out[0]


def register_attention() -> None:
    """Make `ATTENTION_NAME` an attention implementation transformers knows (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
