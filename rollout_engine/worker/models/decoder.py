"""Llama / Qwen2 / Qwen3 decoder over a paged KV cache; parameter names match the checkpoints.

Layers attend over all earlier positions or, where the config says so (`layer_types` of
"sliding_attention", as transformers derives from Qwen's `use_sliding_window` and
`max_window_layers`), over the last `sliding_window` positions only.

With tensor parallelism each rank builds the same module tree holding only its shard (see
`parallel_layers.py`); `shard_specs()` says which slice of each checkpoint tensor that is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kernels import AttentionMetadata, paged_attention, store_kv_cache
from rollout_engine.protocol import ModelLoadError
from rollout_engine.worker.lora.slots import LoRAPoint, LoRASlots
from rollout_engine.worker.models.layers import (
    GatedMLP,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    apply_rotary,
)
from rollout_engine.worker.models.packed_linear import PackedLinear
from rollout_engine.worker.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from rollout_engine.worker.models.tp_sharding import ShardSpec, attention_shard
from rollout_engine.worker.tp.tp_group import TPGroup


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the supported families (as their transformers modeling code reads
    the config; `native_config.py` checks the config fields themselves)."""

    qkv_bias: bool | None = None
    """Force q/k/v bias (Qwen2); None follows config.attention_bias."""
    o_bias: bool | None = None
    """Force the o_proj bias (Qwen2 has none); None follows config.attention_bias."""
    mlp_bias: bool | None = False
    """Force the MLP biases (Qwen2 and Qwen3 have none, whatever the config says); None
    follows config.mlp_bias (Llama)."""
    qk_norm: bool = False
    """RMSNorm of q and k per head before RoPE (Qwen3)."""


ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(mlp_bias=None),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=True, o_bias=False),
    "Qwen3ForCausalLM": ArchSpec(qk_norm=True),
}


_LAYER_TYPES = ("full_attention", "sliding_attention")
_MODEL_TYPES_WITHOUT_WINDOWS = frozenset({"llama"})
"""Model types whose transformers modeling code reads neither `layer_types` nor
`sliding_window`: every layer attends over the whole sequence, whatever the config holds."""


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def arch_spec_of(config) -> ArchSpec:
    """The native family of a config (Llama when it names no architecture)."""
    return ARCHITECTURES[(getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]]


def sliding_windows_of(config) -> list[int | None]:
    """Per layer, its sliding window (None: full attention), as transformers reads the config:
    `layer_types` when present, else `sliding_window` (if set) for every layer; never for
    Llama, whose modeling code reads neither. ModelLoadError for a layer type this decoder
    cannot run. `sliding_window` is checked only where a layer uses it (Qwen2-MoE sets it to 0
    when no layer slides)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if config.model_type in _MODEL_TYPES_WITHOUT_WINDOWS:
        return [None] * config.num_hidden_layers
    if layer_types is None:
        windows = [window] * config.num_hidden_layers
    else:
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown or len(layer_types) != config.num_hidden_layers:
            raise ModelLoadError(
                f"config.layer_types must name one of {_LAYER_TYPES} for each of the "
                f"{config.num_hidden_layers} layers; got {list(layer_types)}"
            )
        windows = [window if kind == "sliding_attention" else None for kind in layer_types]
    is_used = any(w is not None for w in windows)
    if is_used and (not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"config.sliding_window must be a positive integer, got {window!r}")
    return windows


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them at tensor_parallel_size 1)."""

    def __init__(self, config, spec: ArchSpec, tp: TPGroup, sliding_window: int | None) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        shard = attention_shard(
            config.num_attention_heads, config.num_key_value_heads, tp.size, tp.rank
        )
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        attn_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attn_bias if spec.qkv_bias is None else spec.qkv_bias
        o_bias = attn_bias if spec.o_bias is None else spec.o_bias
        hidden = config.hidden_size
        q_rows = (shard.q_start * head_dim, shard.num_heads * head_dim)
        kv_rows = (shard.kv_start * head_dim, shard.num_kv_heads * head_dim)
        q_size = config.num_attention_heads * head_dim
        kv_size = config.num_key_value_heads * head_dim
        self.q_proj = ColumnParallelLinear(hidden, q_size, qkv_bias, q_rows, tp)
        self.k_proj = ColumnParallelLinear(hidden, kv_size, qkv_bias, kv_rows, tp)
        self.v_proj = ColumnParallelLinear(hidden, kv_size, qkv_bias, kv_rows, tp)
        self.o_proj = RowParallelLinear(q_size, hidden, o_bias, q_rows, tp)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.packed_qkv: PackedLinear | None = None
        """CPU: q|k|v packed as one oneDNN weight (`packed_linear.py`)."""
        self.lora_qkv: LoRAPoint | None = None
        self.lora_o: LoRAPoint | None = None
        """With LoRA enabled: the adapters' deltas of q|k|v and o (`worker/lora/slots.py`)."""

    def forward(
        self,
        hidden: torch.Tensor,
        rope: Rope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.packed_qkv is not None:
            q, k, v = self.packed_qkv(hidden)
        else:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        if self.lora_qkv is not None:
            self.lora_qkv.add(hidden, (q, k, v))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, rope)
        key_cache, value_cache = kv_cache  # [num_blocks, bs, Hkv, D] each
        store_kv_cache(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = paged_attention(q, key_cache, value_cache, metadata, self.scale,
                              self.sliding_window)  # [T, H, D]
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        projected = self.o_proj(out)
        if self.lora_o is not None:
            self.lora_o.add(out, (projected,))
        return projected


class DecoderLayer(nn.Module):
    def __init__(self, config, spec: ArchSpec, tp: TPGroup, sliding_window: int | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, spec, tp, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        mlp_bias = spec.mlp_bias
        if mlp_bias is None:
            mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, mlp_bias, tp,
                            config.hidden_act)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: Rope, kv_cache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it is added): Hugging Face's
        `h = h + attn(norm(h)); h + mlp(norm(h))` with each add carried to the norm after it,
        so that the two can run as one op. `residual` None: `hidden` is the embedding."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config, spec: ArchSpec, max_positions: int, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, tp, window) for window in sliding_windows_of(config)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """The causal LM; `forward` works on a flat ragged batch of tokens."""

    def __init__(self, config, max_positions: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = tp or TPGroup()
        self.model = DecoderModel(config, arch_spec_of(config), max_positions, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.packed_logits: PackedLinear | None = None
        """CPU: the logits' weight packed for oneDNN (`packed_linear.py`)."""

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: per layer (key_cache, value_cache), each
        [num_blocks, bs, Hkv, D] -> [T, hidden]."""
        hidden, residual = self.model.embed_tokens(input_ids), None
        rope = self.model.rotary_emb(positions, hidden.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, rope, kv_cache, metadata)
        if residual is None:  # no layers
            return self.model.norm(hidden)
        return self.model.norm.add_and_norm(hidden, residual)[0]

    @property
    def logits_weight(self) -> torch.Tensor:
        """This rank's [vocab rows, hidden] weight of the logits (the embedding when tied)."""
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] -> float32 logits [R, vocab], whole on every rank."""
        return vocab_parallel_logits(
            hidden, self.logits_weight, self.config.vocab_size, self.tp, self.packed_logits
        )

    def attach_lora(self, slots: LoRASlots, max_rank: int, dtype: torch.dtype) -> None:
        """Give every layer its LoRA points: q|k|v, o, gate|up and down, under the
        checkpoint's (and PEFT's) module names."""
        for i, layer in enumerate(self.model.layers):
            attn, mlp, prefix = layer.self_attn, layer.mlp, f"model.layers.{i}"
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            attn.lora_qkv = slots.add_point(
                [f"{prefix}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")],
                attn.q_proj.in_features, [m.out_features for m in qkv], max_rank, dtype)
            attn.lora_o = slots.add_point([f"{prefix}.self_attn.o_proj"], attn.o_proj.in_features,
                                          [attn.o_proj.out_features], max_rank, dtype)
            mlp.lora_gate_up = slots.add_point(
                [f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"], mlp.gate_proj.in_features,
                [mlp.gate_proj.out_features, mlp.up_proj.out_features], max_rank, dtype)
            mlp.lora_down = slots.add_point([f"{prefix}.mlp.down_proj"], mlp.down_proj.in_features,
                                            [mlp.down_proj.out_features], max_rank, dtype)

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Parameter name -> the slice of the checkpoint tensor of that name it holds."""
        specs: dict[str, ShardSpec] = {}
        for module_name, module in self.named_modules():
            own = module.param_shard_specs() if hasattr(module, "param_shard_specs") else {}
            for name, param in module.named_parameters(recurse=False):
                spec = own.get(name) or ShardSpec(tuple(param.shape))
                specs[f"{module_name}.{name}" if module_name else name] = spec
        return specs
