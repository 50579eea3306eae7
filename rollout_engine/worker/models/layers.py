"""Building blocks shared by the decoder families: RMSNorm, rotary embedding, MLP."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rollout_engine.worker.models.packed_linear import PackedLinear
from rollout_engine.worker.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from rollout_engine.worker.models.tp_sharding import split_evenly
from rollout_engine.worker.tp.tp_group import TPGroup


class RMSNorm(nn.Module):
    """Hugging Face's RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
"""RoPE types the native decoder runs: fixed tables, computed by transformers' own functions
for the scaled ones (not "dynamic" or "longrope", whose frequencies follow the batch)."""


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE type."""
    rope = dict(config.rope_parameters or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        base = rope["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, indexed by position (a non-parameter buffer)."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.config, self.head_dim, self.max_positions = config, head_dim, max_positions
        self.register_buffer("cos_sin", self._build(), persistent=False)

    def _build(self) -> torch.Tensor:
        with torch.device("cpu"):  # also when the model is being built on the meta device
            return self._build_on_cpu()

    def _build_on_cpu(self) -> torch.Tensor:
        inv_freq, scaling = rope_inv_freq(self.config, self.head_dim)
        positions = torch.arange(self.max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        return torch.stack((emb.cos() * scaling, emb.sin() * scaling))  # [2, P, head_dim]

    def rebuild(self) -> None:
        """Recompute the table in place (after its memory was released)."""
        self.cos_sin.copy_(self._build().to(self.cos_sin))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions: [T, 1, head_dim] each, looked up once per step."""
        cos = self.cos_sin[0, positions].to(dtype).unsqueeze(1)
        sin = self.cos_sin[1, positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D], cos/sin: [T, 1, D] (Hugging Face's rotate-half form)."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}
"""`config.hidden_act` values the native MLP runs: the very functions transformers' ACT2FN
calls for them. Any other value goes to the transformers backend (`native_config.py`)."""


class GatedMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)) (SwiGLU with SiLU); gate/up split by output rows
    and down by input columns across tensor-parallel ranks."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, tp: TPGroup | None = None,
        hidden_act: str = "silu",
    ) -> None:
        super().__init__()
        self.act = ACTIVATIONS[hidden_act]
        tp = tp or TPGroup()
        rows = split_evenly(intermediate_size, tp.size, tp.rank, "intermediate_size")
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, rows, tp)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, rows, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, rows, tp)
        self.packed_gate_up: PackedLinear | None = None
        """CPU: gate|up packed as one oneDNN weight (`packed_linear.py`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_gate_up is not None:
            gate, up = self.packed_gate_up(x)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
