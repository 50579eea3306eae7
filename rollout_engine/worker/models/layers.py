"""Building blocks shared by the decoder families: RMSNorm, rotary embedding, MLP.

On the CPU their elementwise work runs through the compiled fused kernels
(`kernels/csrc/fused_ops_cpu.cpp`: one pass per op instead of a chain of torch ops), rounded
where Hugging Face's torch ops round; elsewhere, without the compiled kernels or with gradients
enabled (they have no backward), the torch ops themselves. Under batch invariance the fused ops
sum RMSNorm's squares and take SiLU's exp in the order the mode gives torch's `mean` and
`F.silu` (the trainer's side runs Hugging Face's torch ops), so both give the same bits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_extension
from kernels.triton_utils import batch_invariant_runs_triton
from rollout_engine.batch_invariant import is_batch_invariant_mode_enabled
from rollout_engine.worker.lora.slots import LoRAPoint
from rollout_engine.worker.models.packed_linear import PackedLinear
from rollout_engine.worker.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from rollout_engine.worker.models.tp_sharding import split_evenly
from rollout_engine.worker.tp.tp_group import TPGroup


def runs_fused(x: torch.Tensor) -> bool:
    """Whether ops on `x` run through the compiled fused CPU kernels (see the module doc)."""
    if x.device.type != "cpu" or torch.is_grad_enabled() or not cpu_extension.available():
        return False
    # Batch invariance: the fused ops' invariant forms take float32 and 16-bit dtypes, and
    # the CPU's order (not the Triton kernels', which Triton's interpreter runs on the CPU).
    return not is_batch_invariant_mode_enabled() or (
        x.dtype != torch.float64 and not batch_invariant_runs_triton(x))


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Hugging Face's RMSNorm of x through the fused op, or None where the torch ops must run."""
    if runs_fused(x) and weight.dtype == x.dtype:
        return cpu_extension.rms_norm(x, weight, eps, is_batch_invariant_mode_enabled())
    return None


class RMSNorm(nn.Module):
    """Hugging Face's RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_rms_norm(x, self.weight, self.eps)
        if fused is not None:
            return fused
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, x: torch.Tensor,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a residual connection and the norm after it. The
        fused path writes both into x's and residual's memory (both the caller's to give)."""
        if (runs_fused(x) and self.weight.dtype == x.dtype == residual.dtype
                and x.is_contiguous() and residual.is_contiguous()):
            cpu_extension.add_rms_norm(x, residual, self.weight, self.eps,
                                       is_batch_invariant_mode_enabled())
            return x, residual
        residual = x + residual
        return self(residual), residual


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

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """One step's rotary inputs for these positions."""
        return Rope(self.cos_sin, positions, dtype)


@dataclass
class Rope:
    """One step's rotary inputs, shared by its layers: the table and the tokens' positions."""

    cos_sin: torch.Tensor
    """[2, max_positions, head_dim]."""
    positions: torch.Tensor
    """[T]."""
    dtype: torch.dtype

    @functools.cached_property
    def cos_and_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at the positions in the model dtype: [T, 1, head_dim] each, looked up once
        per step (the torch path)."""
        cos = self.cos_sin[0, self.positions].to(self.dtype).unsqueeze(1)
        sin = self.cos_sin[1, self.positions].to(self.dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D] (Hugging Face's rotate-half form). The fused path rotates
    them in place (views into the step's own projection output)."""
    if (runs_fused(q) and rope.cos_sin.dtype == torch.float32
            and rope.positions.dtype == torch.int64 and rope.positions.is_contiguous()):
        cpu_extension.rotary(q, k, rope.cos_sin, rope.positions)
        return q, k
    cos, sin = rope.cos_and_sin
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
        self.lora_gate_up: LoRAPoint | None = None
        self.lora_down: LoRAPoint | None = None
        """With LoRA enabled: the adapters' deltas of gate|up and down (`worker/lora/slots.py`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
            if self.lora_gate_up is not None:
                self.lora_gate_up.add(x, (gate, up))
            return self._down(self.act(gate) * up)
        gate_up = self.packed_gate_up(x, split=False)
        if self.lora_gate_up is not None:
            self.lora_gate_up.add(x, gate_up.split(self.packed_gate_up.split_sizes, -1))
        if self.act is F.silu and runs_fused(x):
            return self._down(cpu_extension.silu_and_mul(gate_up,
                                                         is_batch_invariant_mode_enabled()))
        gate, up = gate_up.split(self.packed_gate_up.split_sizes, -1)
        return self._down(self.act(gate) * up)

    def _down(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(hidden)
        if self.lora_down is not None:
            self.lora_down.add(hidden, (out,))
        return out
