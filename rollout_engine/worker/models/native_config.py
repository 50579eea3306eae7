"""What the native decoder implements, config field by config field: the one table the model
registry (`registry.resolve_model_impl`) checks a checkpoint's config against.

A field the decoder does not implement for the value a checkpoint holds would run a different
model than Hugging Face's (wrong tokens, no error): `model_impl="auto"` then takes the
transformers backend, and `model_impl="native"` refuses the checkpoint naming the field.

Fields the decoder reads without a row here are structural (sizes, head counts: a wrong one
fails at weight loading) or do not change the output (`attention_dropout`, `initializer_range`,
`pretraining_tp`, token ids, `use_cache`). What the families fix in code rather than read from
the config (Qwen2's q/k/v biases, Qwen3's q/k norms, which family reads `mlp_bias`) is
`decoder.ARCHITECTURES`.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_engine.protocol import ModelLoadError
from rollout_engine.worker.models.decoder import ARCHITECTURES, sliding_windows_of
from rollout_engine.worker.models.layers import ACTIVATIONS, ROPE_TYPES

_MISSING = object()


@dataclass(frozen=True)
class FieldSupport:
    """One config field: the values the native decoder runs exactly as transformers does."""

    name: str
    implemented: str
    """What the decoder implements, for the message."""
    is_implemented: Callable[[Any, Any], bool]
    """(value, config) -> whether the decoder runs this value; the value is `_MISSING` when the
    config lacks the field."""
    shown_with: tuple[str, ...] = ()
    """Other fields the check reads, shown with this one when it fails."""


def _is_bool(value: Any, _config: Any) -> bool:
    return value is _MISSING or isinstance(value, bool)


def _is_positive_number(value: Any, _config: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0


def _is_head_dim(value: Any, _config: Any) -> bool:
    # RoPE rotates the two halves of each head: the size must be even.
    return value in (None, _MISSING) or (isinstance(value, int) and value > 0 and value % 2 == 0)


def _is_rope(value: Any, _config: Any) -> bool:
    if not isinstance(value, dict) or any(isinstance(v, dict) for v in value.values()):
        return False  # also RoPE parameters per layer type ({"full_attention": {...}, ...})
    if value.get("rope_type", "default") not in ROPE_TYPES or "rope_theta" not in value:
        return False
    # transformers' default RoPE of these families ignores partial_rotary_factor; the scaled
    # ones would rotate part of each head, which neither runs.
    return value.get("rope_type", "default") == "default" or (
        value.get("partial_rotary_factor", 1.0) == 1.0
    )


def _is_partial_rotary_factor(value: Any, config: Any) -> bool:
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    return value in (_MISSING, None, 1.0) or rope_type == "default"


def _is_window_config(_value: Any, config: Any) -> bool:
    try:
        sliding_windows_of(config)
    except ModelLoadError:
        return False
    return True


NATIVE_CONFIG_FIELDS: tuple[FieldSupport, ...] = (
    FieldSupport("hidden_act", f"one of {sorted(ACTIVATIONS)}",
                 lambda value, _: isinstance(value, str) and value in ACTIVATIONS),
    FieldSupport("rms_norm_eps", "a positive number (RMSNorm in float32)", _is_positive_number),
    FieldSupport("attention_bias", "true or false (q/k/v/o biases)", _is_bool),
    FieldSupport("mlp_bias", "true or false (gate/up/down biases, Llama)", _is_bool),
    FieldSupport("head_dim", "unset or an even positive integer", _is_head_dim),
    FieldSupport("rope_parameters", f"rope_type one of {sorted(ROPE_TYPES)}, one set for every "
                 "layer, a whole-head rotation", _is_rope),
    FieldSupport("partial_rotary_factor", "1.0 (a whole-head rotation)", _is_partial_rotary_factor),
    FieldSupport("tie_word_embeddings", "true or false", _is_bool),
    FieldSupport("layer_types", "full_attention or sliding_attention per layer, with a positive "
                 "sliding_window where a layer slides (Qwen2, Qwen3; Llama reads neither)",
                 _is_window_config, shown_with=("sliding_window",)),
    FieldSupport("quantization_config", "unset (weights as they are in the checkpoint)",
                 lambda value, _: value in (_MISSING, None)),
)
"""Every config field the native decoder depends on whose value changes the model."""

UNCHECKED_CONFIG_FIELDS = frozenset({
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "num_hidden_layers", "vocab_size", "max_position_embeddings",  # structural
    "sliding_window",  # checked with layer_types
    "attention_dropout", "pad_token_id", "_attn_implementation",  # no effect on our output
})
"""The other config fields transformers' Llama / Qwen2 / Qwen3 modeling code reads: sizes a
wrong checkpoint fails on at weight loading, and fields that do not change inference."""


def unimplemented_fields(config) -> list[str]:
    """What in `config` the native decoder does not run exactly, one line per field, naming
    it and its value ([] when it runs the whole config). The architecture comes first."""
    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    if architecture not in ARCHITECTURES:
        return [(f"architecture {architecture!r} has no native implementation (native: "
                 f"{sorted(ARCHITECTURES)})")]
    return [
        f"{_shown(config, field)} (native implements: {field.implemented})"
        for field in NATIVE_CONFIG_FIELDS
        if not field.is_implemented(getattr(config, field.name, _MISSING), config)
    ]


def _shown(config, field: FieldSupport) -> str:
    values = ((name, getattr(config, name, _MISSING)) for name in (field.name, *field.shown_with))
    return ", ".join(f"{name}={'unset' if v is _MISSING else repr(v)}" for name, v in values)
