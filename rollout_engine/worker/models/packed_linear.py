"""CPU: the linear layers through oneDNN, with their weights packed once into its blocked layout.

On the engine's small GEMMs (64-256 rows of a decode step) oneDNN with a packed weight is
1.3-2.0x faster than `F.linear` (MKL), which re-lays the weight out at every call (figures in
benchmarks/README.md). q|k|v and gate|up are packed as one weight each: one GEMM instead of
three or two.

Under batch invariance (`ModelConfig.batch_invariant`) the same fused linears run the
batch-invariant GEMM on its own packed layout (`rollout_engine.batch_invariant`): each output
column's bits are those of its own linear alone, so fusing q|k|v and gate|up changes none, and
the call skips the mode's per-call routing.

A packed weight is a derived copy, outside the `weights` pool: the parameters stay the
checkpoint's tensors, whose addresses, updates and sleep backups the engine manages. So the
copies are dropped whenever the weights change or leave (a completed weight update, sleep)
and packed again by the next forward (`PackedWeights.ensure`). They cost as much memory as
the linear weights while the engine is awake (twice as much for bfloat16 weights packed as
float32, below).

bfloat16 weights on a CPU without bfloat16 arithmetic (no AVX-512 BF16) are packed as float32
copies: there oneDNN emulates a bfloat16 GEMM, 3-4.5x slower than float32 at these shapes
(Intel Xeon, AVX-512 without BF16, 256 rows, 2 threads: 59-66 against 192-282 GFLOP/s), and
on AVX2 it cannot pack one at all. The inputs are widened to float32 and the outputs rounded
back to bfloat16: a product of two bfloat16 values is exact in float32, and oneDNN's bfloat16
GEMM also sums in float32 and rounds once, so the outputs are what its bfloat16 GEMM gives, up
to the order of the sums (`gemm_dtype`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels import cpu_extension
from rollout_engine.worker.cpu_features import cpu_computes_bf16
from rollout_engine.worker.models.experts import PackedExperts, can_pack_experts, pack_experts

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
BATCH_SIZE_HINT = 64
"""oneDNN's hint of the rows a packed weight will see; any row count works (measured: from 1
to 2,048 the hint changes no GEMM's speed here)."""


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build of torch, on this CPU, runs packed linears for weights on `device` of
    `dtype` (in `gemm_dtype(dtype)`)."""
    return (
        device.type == "cpu" and dtype in PACKABLE_DTYPES and torch.backends.mkldnn.is_available()
        and _cpu_packs(gemm_dtype(dtype))
    )


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a packed linear of `dtype` weights computes in: float32 for bfloat16 weights
    on a CPU without bfloat16 arithmetic (see the module doc), else `dtype`. (oneDNN's bf16
    path, where it is used, runs on AVX-512 BF16 or AMX.)"""
    if dtype == torch.bfloat16 and not cpu_computes_bf16():
        return torch.float32
    return dtype


@functools.cache
def _cpu_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs (and runs) a small linear of `dtype` on this CPU: asked once."""
    try:
        pack([torch.ones(16, 16, dtype=dtype)])(torch.ones(1, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


def row_bucket(num_rows: int) -> int:
    """The row count a GEMM of `num_rows` rows runs at: a multiple of 16 up to 256, then four
    buckets to each doubling (320, 384, 448, 512, 640, ...: a quarter of the power of two below
    apart), so at most a quarter more rows than asked. oneDNN builds and caches a primitive for
    every distinct row count (measured: about 0.5 MB of resident memory each for a small weight,
    kept until its cache of 1,024 fills), and a step's row count varies with the batch: padding
    to a few buckets bounds that memory, for a few padded rows' work. (Buckets of 256 above 256
    padded 264 rows to 512: the `small` model's layer linears took 19.6 ms at 264 rows instead
    of 11.1; at 320, 12.3.)"""
    if num_rows <= 256:
        return max(16, -(-num_rows // 16) * 16)
    step = (1 << ((num_rows - 1).bit_length() - 1)) // 4
    return -(-num_rows // step) * step


@dataclass
class PackedLinear:
    """One or more linears with the same input, as one packed GEMM."""

    weight: torch.Tensor
    """[sum of out features, in features], in oneDNN's layout (opaque), in `gemm_dtype` of the
    weights' dtype."""
    bias: torch.Tensor | None
    split_sizes: list[int] | None
    """Out features of each fused linear (None: one linear)."""
    out_features: int
    invariant: bool = False
    """`weight` is in the batch-invariant GEMM's layout (`cpu_extension.batch_invariant_pack`),
    which runs it (any row count: its bits do not depend on it, so no bucket)."""

    def __call__(self, x: torch.Tensor,
                 split: bool = True) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """x: [..., in features] -> [..., out features] (split when fused, unless `split` is
        False)."""
        leading = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        num_rows, out_dtype = x.shape[0], x.dtype
        if self.invariant:
            out = cpu_extension.batch_invariant_linear_packed(x, self.weight, self.out_features,
                                                             self.bias)
        else:
            x = x.to(self.weight.dtype)  # bfloat16 inputs of float32 copies: see `gemm_dtype`
            bucket = row_bucket(num_rows)
            if bucket != num_rows:
                x = torch.cat([x, x.new_zeros(bucket - num_rows, x.shape[1])])
            out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        out = out[:num_rows].to(out_dtype).reshape(*leading, -1)
        return out if self.split_sizes is None or not split else out.split(self.split_sizes, -1)

    @property
    def num_bytes(self) -> int:
        bias_bytes = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + bias_bytes


def pack(weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None,
         invariant: bool = False) -> PackedLinear:
    """Linears of the same input, their weights side by side (fused along the output), packed
    (for the batch-invariant GEMM with `invariant`). `biases` None: no bias here (or the caller
    adds it, as a row-parallel linear does after the all-reduce)."""
    weights = [w.detach() for w in weights]
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    bias = None
    if biases is not None:
        bias = torch.cat([b.detach() for b in biases])  # a copy, also of a single bias
    if invariant:
        packed = cpu_extension.batch_invariant_pack(weight)
    else:
        compute_dtype = gemm_dtype(weight.dtype)
        weight = weight.to(compute_dtype)
        bias = None if bias is None else bias.to(compute_dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_SIZE_HINT)
    split_sizes = [w.shape[0] for w in weights] if len(weights) > 1 else None
    return PackedLinear(packed, bias, split_sizes, weight.shape[0], invariant)


def _pack_linears(linears: list[torch.nn.Linear], with_bias: bool,
                  invariant: bool = False) -> PackedLinear:
    biases = [linear.bias for linear in linears] if with_bias else None
    if biases is not None and biases[0] is None:
        biases = None
    return pack([linear.weight for linear in linears], biases, invariant)


class PackedCopies:
    """Packed copies of a model's linears, built by the first forward that needs them
    (`ensure`) and dropped when the weights change (`drop`). Subclasses say where the copies
    go: `_install` packs and hands them to the modules, `_uninstall` takes them back."""

    def __init__(self) -> None:
        self._copies: list[PackedLinear | PackedExperts] = []
        self.is_packed = False
        self.num_packs = 0
        """How many times the weights were packed (once per load, wake or update)."""

    @torch.inference_mode()
    def ensure(self) -> None:
        """Pack every linear unless they are packed already."""
        if self.is_packed:
            return
        self._copies = self._install()
        self.is_packed = True
        self.num_packs += 1

    def drop(self) -> None:
        """Forget the packed copies (the weights changed or are about to be released)."""
        self._uninstall()
        self._copies = []
        self.is_packed = False

    @property
    def num_bytes(self) -> int:
        """Memory the packed copies hold now."""
        return sum(copy.num_bytes for copy in self._copies)

    def _install(self) -> list[PackedLinear | PackedExperts]:
        raise NotImplementedError

    def _uninstall(self) -> None:
        raise NotImplementedError


class PackedWeights(PackedCopies):
    """The native decoder's linears, q|k|v and gate|up fused. Each layer module reads its own
    (`packed_qkv`, `packed`...); None means the plain `F.linear` path. `invariant`: for the
    batch-invariant GEMM (see the module doc)."""

    def __init__(self, model: torch.nn.Module, invariant: bool = False) -> None:
        super().__init__()
        self.model = model
        self.invariant = invariant

    def _install(self) -> list[PackedLinear]:
        copies = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fused = functools.partial(_pack_linears, invariant=self.invariant)
            attn.packed_qkv = fused([attn.q_proj, attn.k_proj, attn.v_proj], True)
            # A row-parallel linear's bias is added once, after the all-reduce.
            attn.o_proj.packed = fused([attn.o_proj], attn.o_proj.tp.size == 1)
            mlp.packed_gate_up = fused([mlp.gate_proj, mlp.up_proj], True)
            mlp.down_proj.packed = fused([mlp.down_proj], mlp.down_proj.tp.size == 1)
            copies += [attn.packed_qkv, attn.o_proj.packed, mlp.packed_gate_up,
                       mlp.down_proj.packed]
        self.model.packed_logits = pack([self.model.logits_weight], invariant=self.invariant)
        return [*copies, self.model.packed_logits]

    def _uninstall(self) -> None:
        for layer in self.model.model.layers:
            layer.self_attn.packed_qkv = layer.self_attn.o_proj.packed = None
            layer.mlp.packed_gate_up = layer.mlp.down_proj.packed = None
        self.model.packed_logits = None


class PackedModuleLinears(PackedCopies):
    """The same for a model whose module tree is not ours (the transformers backend): every
    `nn.Linear` runs on a packed copy of its own weight (no fusion), its `forward` replaced
    by the packed call while packed and given back when dropped; the experts of its
    mixture-of-experts layers get their grouped kernel's copies (`experts.py`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.linears = [
            m for m in model.modules()
            if type(m) is torch.nn.Linear and m.weight.dtype in PACKABLE_DTYPES
        ]
        self.experts = [m for m in model.modules() if can_pack_experts(m)]

    def _install(self) -> list[PackedLinear | PackedExperts]:
        for linear in self.linears:
            # An instance attribute: nn.Module.__call__ finds it before the class's forward.
            linear.forward = _pack_linears([linear], True)
        for module in self.experts:
            module.packed_experts = pack_experts(module)
        return ([linear.forward for linear in self.linears]
                + [module.packed_experts for module in self.experts])

    def _uninstall(self) -> None:
        for linear in self.linears:
            linear.__dict__.pop("forward", None)  # nn.Linear.forward again
        for module in self.experts:
            module.packed_experts = None
