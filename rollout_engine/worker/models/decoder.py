"""Llama / Qwen2 / Qwen3 decoder over a paged KV cache; parameter names match the checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import AttentionMetadata, paged_attention, store_kv_cache
from rollout_engine.worker.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the supported families."""

    qkv_bias: bool | None = None
    """Force q/k/v bias (Qwen2); None follows config.attention_bias."""
    qk_norm: bool = False
    """RMSNorm of q and k per head before RoPE (Qwen3)."""


ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=True),
    "Qwen3ForCausalLM": ArchSpec(qk_norm=True),
}


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    def __init__(self, config, spec: ArchSpec) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        attn_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attn_bias if spec.qkv_bias is None else spec.qkv_bias
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=attn_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = spec.qk_norm

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [num_blocks, bs, Hkv, D] each
        store_kv_cache(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = paged_attention(q, key_cache, value_cache, metadata, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config, spec: ArchSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, spec)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, mlp_bias)

    def forward(self, hidden, rope, kv_cache, metadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    def __init__(self, config, spec: ArchSpec, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """The causal LM; `forward` works on a flat ragged batch of tokens."""

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        architecture = (config.architectures or ["LlamaForCausalLM"])[0]
        self.config = config
        self.model = DecoderModel(config, ARCHITECTURES[architecture], max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: [L, 2, num_blocks, bs, Hkv, D] -> [T, hidden]."""
        hidden = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(positions, hidden.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden = layer(hidden, rope, kv_cache, metadata)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] -> float32 logits [R, vocab]."""
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()
