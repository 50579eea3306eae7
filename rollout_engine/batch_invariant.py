"""Batch-invariant kernels, and the mode that puts them under a Hugging Face model's forward.

The same token's logprob comes out of the engine and the trainer with other bits when the ops
under it reduce in an order that depends on the batch: a BLAS picks another kernel, blocking or
thread split for a batch of 1, 2 or 64 rows, so a request's logits change when others join its
step, and the trainer's padded full-sequence forward differs from the engine's ragged steps. The
kernels here compute every output in one order fixed by the model's shapes alone (see
`kernels/csrc/batch_invariant_cpu.cpp`): the bits of a row do not depend on the other rows, on
its place in the batch or on the number of threads.

`set_batch_invariant_mode()` (the name of Thinking Machines' `batch_invariant_ops`) is a context
manager: inside it, in this thread, `torch.nn.functional.linear` (every `nn.Linear`, the LM head
included) runs the batch-invariant linear layer, with a backward pass of plain matmuls (gradients
need not be invariant, only correct).

    with set_batch_invariant_mode():
        logits = model(input_ids, attention_mask=mask).logits

What is covered so far: linear layers on the CPU, in float32, bfloat16, float16 and float64.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kernels import cpu_extension


class BatchInvariantUnavailableError(RuntimeError):
    """The batch-invariant kernels cannot run here (no compiled CPU kernel, another device)."""


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` (x [..., K], weight [N, K], bias [N]) with every output in one fixed order;
    differentiable."""
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise BatchInvariantUnavailableError(
            f"the batch-invariant linear layer runs on the CPU only (got {x.device.type})")
    if not cpu_extension.available():
        raise BatchInvariantUnavailableError(
            "the batch-invariant linear layer needs the compiled CPU kernels (`make cpu-kernel`; "
            "a C++ compiler; ROLLOUT_ENGINE_CPU_KERNEL not 0)")
    return _Linear.apply(x, weight, bias)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        rows = x.reshape(-1, x.shape[-1])
        out = cpu_extension.batch_invariant_linear(rows, weight, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_rows @ weight).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = grad_rows.t() @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_rows.sum(0)
        return grad_x, grad_w, grad_b


class _BatchInvariantMode(TorchFunctionMode):
    """Routes `F.linear` to `linear`; every other function runs as it would."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear or func is torch._C._nn.linear:
            return linear(*args, **kwargs)
        return func(*args, **kwargs)


_state = threading.local()


def is_batch_invariant_mode_enabled() -> bool:
    """Whether this thread is inside `set_batch_invariant_mode()`."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def set_batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Run the body (in this thread) with the batch-invariant ops; `enabled=False` leaves the
    ops as they are (so callers can pass a flag through). Raises
    `BatchInvariantUnavailableError` at entry where the kernels cannot run."""
    if not enabled:
        yield
        return
    if not cpu_extension.available():
        raise BatchInvariantUnavailableError(
            "batch-invariant mode needs the compiled CPU kernels (`make cpu-kernel`; a C++ "
            "compiler; ROLLOUT_ENGINE_CPU_KERNEL not 0)")
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with _BatchInvariantMode():
            yield
    finally:
        _state.depth -= 1
