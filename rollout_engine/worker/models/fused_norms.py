"""The transformers backend's RMSNorm modules on the compiled fused CPU op, where that op gives
what the module's own forward gives.

Most of Hugging Face's RMSNorm classes (one per model family) compute Llama's formula,
`weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)`, which `cpu_extension.rms_norm`
computes in one pass (`kernels/csrc/fused_ops_cpu.cpp`) instead of seven torch ops; others do
not (Gemma scales by 1 + weight, some round before the product, some gate). So nothing is
chosen by class name: each module with a 1-D `weight` and an epsilon is run both ways on random
rows in the model's dtype, and only one whose outputs agree gets the fused forward (in 16-bit
dtypes bit for bit but for a rare last-bit flip from the sum of squares' order, which a formula
that rounds elsewhere exceeds many times over; in float32 within a few units in the last
place). With autograd or off the CPU the module's own forward runs (`layers.fused_rms_norm`);
under batch invariance too, unless the op's batch-invariant form gives, bit for bit, what the
module's forward gives in that mode (where the trainer runs it).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from kernels import cpu_extension
from rollout_engine.batch_invariant import (
    BatchInvariantUnavailableError,
    is_batch_invariant_mode_enabled,
    set_batch_invariant_mode,
)
from rollout_engine.worker.models.layers import fused_rms_norm

_EPSILON_NAMES = ("variance_epsilon", "eps", "epsilon")
_PROBE_ROWS = 64
_MAX_FLIPPED_SHARE = 1e-3
"""16-bit dtypes: the share of elements allowed one unit in the last place apart."""


def fuse_rms_norms(model: nn.Module) -> list[str]:
    """Give every RMSNorm module of `model` that the fused op computes exactly a forward on it;
    the names of those modules (none without the compiled kernels or off the CPU)."""
    fused = []
    for name, module in model.named_modules():
        eps = _epsilon_of(module)
        if eps is None or not _agrees(module, eps):
            continue
        module.forward = _fused_forward(module, module.forward, eps,
                                        _agrees_invariantly(module, eps))
        fused.append(name)
    return fused


def _epsilon_of(module: nn.Module) -> float | None:
    weight = getattr(module, "weight", None)
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.device.type != "cpu"
            or getattr(module, "bias", None) is not None or list(module.children())):
        return None
    for name in _EPSILON_NAMES:
        eps = getattr(module, name, None)
        if isinstance(eps, float):
            return eps
    return None


@torch.inference_mode()
def _agrees(module: nn.Module, eps: float) -> bool:
    """Whether the fused op gives the module's own outputs on random rows (see the module doc)."""
    weight = module.weight
    if not cpu_extension.available() or not weight.dtype.is_floating_point:
        return False
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(_PROBE_ROWS, weight.shape[0], generator=generator) * 3).to(weight.dtype)
    try:
        expected = module(x)
    except Exception:  # noqa: BLE001 - a norm that takes more than the rows (gated): not ours
        return False
    if (not isinstance(expected, torch.Tensor) or expected.shape != x.shape
            or expected.dtype != weight.dtype):
        return False
    got = cpu_extension.rms_norm(x, weight, eps)
    difference = (got.float() - expected.float()).abs()
    ulp = torch.finfo(weight.dtype).eps * expected.float().abs().clamp_min(1e-3)
    if weight.dtype == torch.float32:
        return bool((difference <= 4 * ulp).all())
    flipped = (got != expected).float().mean().item()
    return bool((difference <= ulp).all()) and flipped <= _MAX_FLIPPED_SHARE


@torch.inference_mode()
def _agrees_invariantly(module: nn.Module, eps: float) -> bool:
    """Whether the op's batch-invariant form equals the module's forward in the mode, in the
    module's dtype and in a float32 copy of it (whose last bits show a formula that reduces in
    another order, which a 16-bit rounding would mostly hide)."""
    if module.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(_PROBE_ROWS, module.weight.shape[0], generator=generator) * 3
    for probe in (module, copy.deepcopy(module).float()):
        x = rows.to(probe.weight.dtype)
        try:
            with set_batch_invariant_mode():
                expected = probe(x)
        except BatchInvariantUnavailableError:
            return False
        if not torch.equal(cpu_extension.rms_norm(x, probe.weight, eps, invariant=True),
                           expected):
            return False
    return True


def _fused_forward(module: nn.Module, own_forward, eps: float, invariant: bool):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if not invariant and is_batch_invariant_mode_enabled():
            return own_forward(hidden_states)
        fused = fused_rms_norm(hidden_states, module.weight, eps)
        return own_forward(hidden_states) if fused is None else fused

    return forward
