"""Batch-invariant kernels, and the mode that puts them under a Hugging Face model's forward.

The same token's logprob comes out of the engine and the trainer with other bits when the ops
under it reduce in an order that depends on the batch: a BLAS picks another kernel, blocking or
thread split for a batch of 1, 2 or 64 rows, so a request's logits change when others join its
step, and the trainer's padded full-sequence forward differs from the engine's ragged steps. The
kernels here compute every output in one order fixed by the model's shapes alone (see
`kernels/csrc/batch_invariant_cpu.cpp`): the bits of a row do not depend on the other rows, on
its place in the batch or on the number of threads.

`set_batch_invariant_mode()` (the name of Thinking Machines' `batch_invariant_ops`) is a context
manager. Inside it, in this thread:

- `torch.nn.functional.linear` (every `nn.Linear`, the LM head included) and `torch._grouped_mm`
  (the experts of a mixture-of-experts layer) run the batch-invariant linear layer;
- `F.scaled_dot_product_attention` (a Hugging Face model's "sdpa" attention) and the engine's
  paged attention run the batch-invariant attention (`batch_invariant_attention_cpu.cpp`);
- on the CPU, `mean` over the last dimension (an RMSNorm's) and `F.silu` run kernels of fixed
  steps (`fused_ops_cpu.cpp`) whose order the engine's fused RMSNorm and SiLU-and-mul follow
  in the mode, so that they equal Hugging Face's unfused torch ops;

each with a backward pass of plain torch ops (gradients need not be invariant, only correct).
The engine runs its steps in it with `LLM(..., batch_invariant=True)`: a token's logprob is then
the same whatever else the step holds, and equal to a trainer's forward in the mode with the
positions the engine uses (counted from each sequence's first token):

    with set_batch_invariant_mode():
        logits = model(input_ids, attention_mask=mask, position_ids=positions).logits

On CUDA the same ops run Triton kernels (`kernels/triton_batch_invariant.py`), and the row
reductions whose CUDA kernels split a row by the batch's size run there too: `mean` over the last
dimension (an RMSNorm's), `log_softmax` and `softmax` over it. Their bits are the GPU's own,
not the CPU kernels'.

Covered: linear layers (float32, bfloat16, float16; float64 on the CPU) and attention (float32,
bfloat16, float16); the native decoder and the transformers backend. Not yet: attention softcap
and sinks on the CPU; on CUDA, sdpa masks other than padded causal ones.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kernels import cpu_extension
from kernels.dispatch import batch_invariant_attention
from kernels.triton_utils import batch_invariant_runs_triton as runs_triton


class BatchInvariantUnavailableError(RuntimeError):
    """The batch-invariant kernels cannot run here (no compiled CPU kernel, another device)."""


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` (x [..., K], weight [N, K], bias [N]) with every output in one fixed order;
    differentiable."""
    _require_kernels(x, weight, *(() if bias is None else (bias,)))
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    return _linear_forward(x, weight, bias)  # no autograd node: the engine's steps


def _linear_forward(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if runs_triton(x):
        from kernels import triton_batch_invariant

        out = triton_batch_invariant.linear(rows, weight, bias)
    else:
        if getattr(_state, "reuse_packed", False):
            packed = _PACKED.get(weight)
        else:
            packed = cpu_extension.batch_invariant_pack(weight.detach())
        out = cpu_extension.batch_invariant_linear_packed(rows, packed, weight.shape[0], bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear_forward(x, weight, bias)

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


class _PackedWeights:
    """The linear kernel's copies of the weights it has run, in its layout (panels of 16 output
    columns, `kernels.cpu_extension.batch_invariant_pack`), for callers that own their weights'
    changes (`set_batch_invariant_mode(reuse_packed_weights=True)`: the engine). A copy is
    packed at a weight's first call, reused while the weight is unchanged, packed again when
    torch saw it change (its version counter, its address), forgotten when the weight is
    collected or on `drop()`. Writes torch does not see (through `.data`, to inference tensors)
    are the owner's to announce with `drop_packed_weights()`: the engine drops the copies at
    every weight update and sleep. A copy costs as much memory as its weight.

    Without reuse (a trainer, whose optimizer and weight syncs write where they like) every
    call packs its weight afresh: a copy of N x K against the call's M x N x K multiply-adds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[int, tuple[weakref.ref, dict[tuple, tuple]]] = {}
        """id(owner) -> (weak reference to it, {layout: (address, version, packed copy)}): the
        owner is the weight, or the tensor it views (an expert's slice of a 3-D weight)."""

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        owner = weight if weight._base is None else weight._base
        layout = (tuple(weight.shape), weight.stride(), weight.storage_offset(), weight.dtype)
        stamp = (weight.data_ptr(), None if weight.is_inference() else weight._version)
        key = id(owner)
        with self._lock:
            entry = self._owners.get(key)
            copy = entry[1].get(layout) if entry is not None and entry[0]() is owner else None
        if copy is not None and copy[:2] == stamp:
            return copy[2]
        packed = cpu_extension.batch_invariant_pack(weight.detach())
        with self._lock:
            entry = self._owners.get(key)
            if entry is None or entry[0]() is not owner:
                entry = self._owners[key] = (weakref.ref(owner, self._forget(key)), {})
            entry[1][layout] = (*stamp, packed)
        return packed

    def _forget(self, key: int):
        def forget(ref: weakref.ref) -> None:
            with self._lock:
                if key in self._owners and self._owners[key][0] is ref:
                    del self._owners[key]
        return forget

    def drop(self) -> None:
        with self._lock:
            self._owners.clear()

    @property
    def num_bytes(self) -> int:
        with self._lock:
            copies = [copy for _, layouts in self._owners.values() for copy in layouts.values()]
        return sum(packed.numel() * packed.element_size() for *_, packed in copies)


_PACKED = _PackedWeights()


def drop_packed_weights() -> None:
    """Forget the linear kernel's packed copies of every weight (this process): call it when
    weights change in place without torch seeing it (inference tensors) or leave memory (the
    engine does at weight updates and sleep). The next call packs again."""
    _PACKED.drop()


def packed_weights_bytes() -> int:
    """Memory the linear kernel's packed copies hold now."""
    return _PACKED.num_bytes


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
               bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch._grouped_mm` as mixture-of-experts layers call it (rows [S, K] sorted by expert,
    expert weights [E, K, N], `offs` the cumulative row counts): each expert's rows through the
    batch-invariant linear layer; differentiable. Rows past the last offset are zeros."""
    if mat_a.dim() != 2 or mat_b.dim() != 3 or offs is None or bias is not None or (
            out_dtype not in (None, mat_a.dtype)):
        raise ValueError("batch-invariant grouped_mm takes 2-D rows, 3-D expert weights and "
                         "offs, without bias or another output dtype")
    pieces, start = [], 0
    for expert, end in enumerate(offs.tolist()):
        pieces.append(linear(mat_a[start:end], mat_b[expert].transpose(0, 1)))
        start = end
    pieces.append(mat_a.new_zeros(mat_a.shape[0] - start, mat_b.shape[2]))
    return torch.cat(pieces)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with every output in one fixed order (each query's
    visible keys in groups of 16, counted from its first visible key); differentiable. The mask
    is bool (true = visible) or additive with 0 and -inf (or the dtype's lowest) only. Query
    heads may be a multiple of key/value heads (`enable_gqa` or not). No dropout."""
    _require_kernels(query, key, value)
    if dropout_p:
        raise ValueError("batch-invariant attention has no dropout (dropout_p must be 0)")
    if attn_mask is not None and is_causal:
        raise ValueError("pass attn_mask or is_causal, not both (as sdpa)")
    visible = None if attn_mask is None else _visible(attn_mask)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    return _Attention.apply(query, key, value, visible, is_causal, scale)


def _visible(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    visible = mask == 0
    if not bool(torch.all(visible | (mask <= torch.finfo(mask.dtype).min / 2))):
        raise ValueError("batch-invariant attention takes masks of 0 and -inf only (a bias "
                         "such as ALiBi would need its own kernel)")
    return visible


_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
                          None)
"""sdpa's CPU flash backward, given the forward's output and log-sum-exp (None: not in this
torch; the backward then recomputes sdpa's forward)."""


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, visible, is_causal, scale):
        ctx.is_causal, ctx.scale, ctx.flash = is_causal, scale, False
        if runs_triton(query):
            from kernels import triton_batch_invariant

            ctx.save_for_backward(query, key, value, visible)
            return triton_batch_invariant.dense_attention(query, key, value, visible, is_causal,
                                                          scale)
        # The log-sum-exp only where a backward will take it.
        ctx.flash = (_FLASH_BACKWARD is not None and query.shape[-1] == value.shape[-1]
                     and any(ctx.needs_input_grad[:3]))
        if ctx.flash:
            out, lse = cpu_extension.batch_invariant_attention_lse(query, key, value, visible,
                                                                   is_causal, scale)
            ctx.save_for_backward(query, key, value, visible, out, lse)
            return out
        ctx.save_for_backward(query, key, value, visible)
        return cpu_extension.batch_invariant_attention(query, key, value, visible, is_causal,
                                                       scale)

    @staticmethod
    def backward(ctx, grad_out):
        """Gradients of the same attention from sdpa's own backward (correct, not invariant): on
        the CPU its flash kernel's backward, given our output and log-sum-exp; elsewhere
        recomputing sdpa's forward. Torch's fused kernels, not a float32 score matrix (which
        cost the trainer's step 1.6x its plain time in bf16). A query that sees no key has a
        zero output in both (torch >= 2.5), so no gradient."""
        saved = ctx.saved_tensors  # once: checkpointing refuses a second unpack
        if ctx.flash:
            query, key, value, visible, out, lse = saved
            mask = None if visible is None else torch.zeros(
                visible.shape, dtype=query.dtype).masked_fill_(~visible, float("-inf"))
            grads = _FLASH_BACKWARD(grad_out, query, key, value, out, lse, 0.0,
                                    ctx.is_causal and visible is None, attn_mask=mask,
                                    scale=ctx.scale)
            return (*grads, None, None, None)
        query, key, value, visible = saved
        with torch.enable_grad(), torch._C.DisableTorchFunction():  # not routed back here
            inputs = [t.detach().requires_grad_() for t in (query, key, value)]
            out = F.scaled_dot_product_attention(
                *inputs, attn_mask=visible, is_causal=ctx.is_causal and visible is None,
                scale=ctx.scale, enable_gqa=query.shape[1] != key.shape[1])
            grads = torch.autograd.grad(out, inputs, grad_out)
        return (*grads, None, None, None)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _require_kernels(*tensors: torch.Tensor) -> None:
    """The kernels for these tensors can run (with none: the kernels of some device can)."""
    devices = {t.device.type for t in tensors}
    if len(devices) > 1:
        raise BatchInvariantUnavailableError(f"tensors on several devices: {sorted(devices)}")
    triton_ok = _triton_installed()
    if tensors and runs_triton(tensors[0]):
        if not triton_ok:
            raise BatchInvariantUnavailableError(
                "the batch-invariant kernels on CUDA need Triton (pip install triton)")
        return
    if devices - {"cpu"}:
        raise BatchInvariantUnavailableError(
            f"the batch-invariant kernels run on the CPU and CUDA only (got {sorted(devices)})")
    if not cpu_extension.available() and (tensors or not triton_ok):
        raise BatchInvariantUnavailableError(
            "the batch-invariant kernels need the compiled CPU kernels (`make cpu-kernel`; a "
            "C++ compiler; ROLLOUT_ENGINE_CPU_KERNEL not 0)")


def _row_op(func, op: str, params: tuple[str, ...]):
    """`func` (a mean or a softmax) through the batch-invariant kernel `op` where it reduces
    the last dimension: Triton's for a tensor on the Triton path; on the CPU the compiled
    kernel's mean, whose order the engine's fused RMSNorm follows (torch's CPU softmaxes keep a
    row's bits whatever the batch: they stay torch's), else as it is. `params`: the names of
    `func`'s positional parameters after the tensor."""
    def run(x, *args, **kwargs):
        if not (isinstance(x, torch.Tensor) and (runs_triton(x) or (
                op == "mean" and x.device.type == "cpu" and cpu_extension.available()))):
            return func(x, *args, **kwargs)
        bound = dict(zip(params, args, strict=False)) | kwargs
        dim = bound.get("dim")
        if isinstance(dim, (tuple, list)) and len(dim) == 1:
            dim = dim[0]
        if isinstance(dim, int) and x.dim() and dim in (-1, x.dim() - 1):
            rows = x if bound.get("dtype") is None else x.to(bound["dtype"])
            if rows.dtype in (torch.float32, torch.bfloat16, torch.float16):
                return _RowOp.apply(rows, op, bool(bound.get("keepdim", False)))
        return func(x, *args, **kwargs)
    return run


class _RowOp(torch.autograd.Function):
    """A last-dimension reduction through the batch-invariant kernel; the backward in plain
    torch ops."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, op: str, keepdim: bool):
        from kernels import triton_batch_invariant as tbi

        ctx.op, ctx.keepdim, ctx.length = op, keepdim, x.shape[-1]
        if op == "mean" and not runs_triton(x):
            out = cpu_extension.invariant_mean(x if x.stride(-1) == 1 else x.contiguous())
            return out.unsqueeze(-1) if keepdim else out
        if op == "mean":
            return tbi.mean_last_dim(x, keepdim)
        out = tbi.log_softmax(x) if op == "log_softmax" else tbi.softmax(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.op == "mean":
            grad = grad if ctx.keepdim else grad.unsqueeze(-1)
            return grad.expand(*grad.shape[:-1], ctx.length) / ctx.length, None, None
        (out,) = ctx.saved_tensors
        if ctx.op == "log_softmax":
            return grad - out.exp() * grad.sum(-1, keepdim=True), None, None
        return out * (grad - (grad * out).sum(-1, keepdim=True)), None, None


def silu(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """`F.silu`; on the CPU through the compiled kernel's exp of fixed steps (the engine's fused
    SiLU-and-mul takes the same: `kernels/csrc/fused_ops_cpu.cpp`), elsewhere torch's
    (elementwise on CUDA: the same bits in any batch); differentiable."""
    if not (isinstance(input, torch.Tensor) and input.device.type == "cpu"
            and input.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and cpu_extension.available() and not runs_triton(input)):
        return F.silu(input, inplace)
    if torch.is_grad_enabled() and input.requires_grad:
        out = _Silu.apply(input.clone() if inplace else input)  # its input saved unchanged
    else:
        out = cpu_extension.invariant_silu(input)
    return input.copy_(out) if inplace else out


class _Silu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return cpu_extension.invariant_silu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad, x)


_ROUTES = {
    F.linear: linear, torch._C._nn.linear: linear, torch._grouped_mm: grouped_mm,
    F.scaled_dot_product_attention: attention,
    torch._C._nn.scaled_dot_product_attention: attention,
    F.silu: silu, torch._C._nn.silu: silu,
    # Reductions over a row: CUDA's kernels split a row among threads by the number of rows;
    # on the CPU the mean follows the order of the engine's fused RMSNorm.
    torch.mean: _row_op(torch.mean, "mean", ("dim", "keepdim")),
    torch.Tensor.mean: _row_op(torch.Tensor.mean, "mean", ("dim", "keepdim")),
    torch.log_softmax: _row_op(torch.log_softmax, "log_softmax", ("dim", "dtype")),
    torch.Tensor.log_softmax: _row_op(torch.Tensor.log_softmax, "log_softmax", ("dim", "dtype")),
    F.log_softmax: _row_op(F.log_softmax, "log_softmax", ("dim", "_stacklevel", "dtype")),
    torch.softmax: _row_op(torch.softmax, "softmax", ("dim", "dtype")),
    torch.Tensor.softmax: _row_op(torch.Tensor.softmax, "softmax", ("dim", "dtype")),
    F.softmax: _row_op(F.softmax, "softmax", ("dim", "_stacklevel", "dtype")),
}
if hasattr(F, "grouped_mm"):  # torch >= 2.10
    _ROUTES[F.grouped_mm] = grouped_mm


class _BatchInvariantMode(TorchFunctionMode):
    """Routes `F.linear`, `torch._grouped_mm` (mixture-of-experts layers),
    `F.scaled_dot_product_attention`, `F.silu` and the row reductions of `_ROUTES` to the
    batch-invariant kernels; every other function runs as it would."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        route = _ROUTES.get(func)
        return (route or func)(*args, **(kwargs or {}))


_state = threading.local()


def is_batch_invariant_mode_enabled() -> bool:
    """Whether this thread is inside `set_batch_invariant_mode()`."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def set_batch_invariant_mode(enabled: bool = True, *,
                             reuse_packed_weights: bool = False) -> Iterator[None]:
    """Run the body (in this thread) with the batch-invariant ops; `enabled=False` leaves the
    ops as they are (so callers can pass a flag through). Raises
    `BatchInvariantUnavailableError` at entry where the kernels cannot run.

    `reuse_packed_weights`: keep the linear kernel's packed copy of each weight from one call
    to the next instead of packing it at every call; for a caller that calls
    `drop_packed_weights()` whenever it writes its weights behind torch's back (see
    `_PackedWeights`). The bits are the same either way."""
    if not enabled:
        yield
        return
    _require_kernels()
    _state.depth = getattr(_state, "depth", 0) + 1
    reuse = getattr(_state, "reuse_packed", False)
    _state.reuse_packed = reuse_packed_weights
    try:
        with _BatchInvariantMode(), batch_invariant_attention():
            yield
    finally:
        _state.depth -= 1
        _state.reuse_packed = reuse


def checkpoint_contexts() -> tuple[contextlib.AbstractContextManager,
                                   contextlib.AbstractContextManager]:
    """`context_fn` for `torch.utils.checkpoint` (non-reentrant): the recompute in the backward
    runs in the mode its forward ran in (the backward runs outside the mode's `with` block, and
    recomputing with other kernels would save other tensors). Pass it as
    `gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": checkpoint_contexts}`."""
    return contextlib.nullcontext(), set_batch_invariant_mode(is_batch_invariant_mode_enabled())
