"""The experts of the transformers backend's mixture-of-experts layers, through our grouped kernel.

transformers dispatches an experts module's forward (the classes decorated with
`use_experts_implementation`: Qwen2/3-MoE, OLMoE, Mixtral, DeepSeek...) through its
`ExpertsInterface` by `config._experts_implementation`; the backend registers ours under
`EXPERTS_NAME`. On the CPU, once the weights are packed (`PackedExperts`, built and dropped with
the packed linears of `packed_linear.PackedModuleLinears`), a supported module runs
`kernels/csrc/moe_experts_cpu.cpp`: all of a step's tokens and experts in one call, every expert's
rows through its own packed weights, spread over the threads by (expert, rows, columns). Everything
else on the CPU (weights not packed, a layout or activation the kernel does not have) runs
transformers' own `grouped_mm` implementation, the default it replaces; on CUDA, the same layout
runs our Triton fused MoE (`kernels/triton_moe.py`), except in batch-invariant mode (its tiles
follow the batch; `grouped_mm` then runs each expert through the invariant linear layer).

Measured on two AVX-512 cores (8 experts, 2 per token, hidden 512, expert width 344): float32
3.2x `grouped_mm` at 64 tokens, 1.3x at 1,024; bfloat16 1.6x at 64 tokens but slower than oneDNN's
native bf16 GEMMs past about 48 rows per expert, where `grouped_mm` keeps them. On a CPU without
bfloat16 arithmetic, where oneDNN emulates those GEMMs, the kernel takes every row count: a bf16
Qwen3-MoE's prefill (16 prompts of 512 tokens, 2 threads, Intel Xeon without AVX512_BF16) ran
at 3,080-3,351 prompt tok/s against 1,452-1,640 with `grouped_mm` past 48 rows.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

from kernels import cpu_extension
from rollout_engine.batch_invariant import is_batch_invariant_mode_enabled
from rollout_engine.worker.cpu_features import cpu_computes_bf16

EXPERTS_NAME = "rollout_engine"
"""Our entry in transformers' `ExpertsInterface`."""
MAX_ROWS_PER_EXPERT_LOW_PRECISION = 48
"""bfloat16 (on a CPU with bfloat16 arithmetic) and float16: above this mean of rows per expert,
oneDNN's low-precision GEMMs (`grouped_mm`) beat the kernel's float32 chains (measured crossover
about 50-60, bf16 on AVX512_BF16)."""


@dataclass
class PackedExperts:
    """One experts module's weights in the grouped kernel's layout (`cpu_extension.moe_pack`)."""

    gate_up: torch.Tensor
    """[experts, ceil(2 I / 16), hidden, 16]"""
    down: torch.Tensor
    """[experts, ceil(hidden / 16), I, 16]"""
    intermediate_size: int

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down))


def register_experts() -> None:
    """Make `EXPERTS_NAME` an experts implementation transformers knows (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_NAME, experts_forward)


def use_our_experts(causal_lm: nn.Module) -> None:
    """Route the model's experts modules through `experts_forward` (a no-op for a model whose
    experts transformers does not dispatch)."""
    if any(is_experts_module(m) for m in causal_lm.modules()):
        register_experts()
        causal_lm.set_experts_implementation(EXPERTS_NAME)


def is_experts_module(module: nn.Module) -> bool:
    """An experts module transformers dispatches (its class went through
    `use_experts_implementation`)."""
    return hasattr(module, "has_gate") and hasattr(module, "is_concatenated")


def has_kernel_layout(module: nn.Module) -> bool:
    """Whether our kernels compute this experts module: SiLU-gated, gate|up concatenated in one
    [E, 2I, H] weight, down [E, H, I], no biases, no per-expert norm."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    gate_up = getattr(module, "gate_up_proj", None)
    return (
        is_experts_module(module)
        and module.has_gate and module.is_concatenated and not module.has_bias
        and not module.is_transposed and not module.has_post_expert_norm
        and type(module)._apply_gate is _default_apply_gate
        and isinstance(getattr(module, "act_fn", None), (nn.SiLU, SiLUActivation))
        and isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3
    )


def can_pack_experts(module: nn.Module) -> bool:
    """Whether the grouped CPU kernel computes this experts module (on packed copies)."""
    return (has_kernel_layout(module) and module.gate_up_proj.device.type == "cpu"
            and cpu_extension.available())


def pack_experts(module: nn.Module) -> PackedExperts:
    gate_up = module.gate_up_proj.detach()
    return PackedExperts(cpu_extension.moe_pack(gate_up), cpu_extension.moe_pack(
        module.down_proj.detach()), gate_up.shape[1] // 2)


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """hidden_states [T, H], top_k_index / top_k_weights [T, k] -> [T, H]: with the step's LoRA
    deltas where its adapters target these experts (`lora/expert_deltas.py`), else the grouped
    CPU kernel where it serves, the Triton fused MoE on CUDA, else transformers' `grouped_mm`
    implementation (and always under autograd: our kernels have no backward)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    packed: PackedExperts | None = getattr(module, "packed_experts", None)
    if packed is not None and not _kernel_serves(hidden_states, top_k_index, packed):
        packed = None
    lora = getattr(module, "lora_experts", None)  # an ExpertsLoRAPoint, with enable_lora
    if lora is not None and lora.runs():
        return lora.forward(module, hidden_states, top_k_index, top_k_weights, packed)
    if packed is not None:
        return cpu_extension.moe_experts(hidden_states, top_k_index, top_k_weights,
                                         packed.gate_up, packed.down, packed.intermediate_size)
    if (hidden_states.is_cuda and not torch.is_grad_enabled() and _triton_serves(module)
            and not is_batch_invariant_mode_enabled()):  # its tiles follow the batch
        from kernels.triton_moe import fused_moe_triton

        return fused_moe_triton(hidden_states, top_k_index, top_k_weights,
                                module.gate_up_proj, module.down_proj)
    return grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)


def _triton_serves(module: nn.Module) -> bool:
    serves = getattr(module, "_triton_moe_serves", None)
    if serves is None:  # decided once per module: its layout does not change
        serves = module._triton_moe_serves = (
            has_kernel_layout(module) and importlib.util.find_spec("triton") is not None)
    return serves


def _kernel_serves(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   packed: PackedExperts) -> bool:
    if hidden_states.dtype != packed.gate_up.dtype or torch.is_grad_enabled():
        return False  # no backward here: a trainer's forward keeps transformers' path
    if hidden_states.dtype == torch.float16 or (hidden_states.dtype == torch.bfloat16
                                                and cpu_computes_bf16()):
        num_experts = packed.gate_up.shape[0]
        return top_k_index.numel() <= MAX_ROWS_PER_EXPERT_LOW_PRECISION * num_experts
    return True
