"""The compiled CPU kernels, built on first use: paged attention
(`kernels/csrc/paged_attention_cpu.cpp`), the decoder's fused elementwise ops
(`fused_ops_cpu.cpp`: RMSNorm with its residual add, rotary embedding, SiLU-and-mul) and the
batch-invariant linear layer and attention (`batch_invariant_cpu.cpp`,
`batch_invariant_attention_cpu.cpp`), LoRA (`lora_cpu.cpp`) and the grouped experts of a
mixture-of-experts layer (`moe_experts_cpu.cpp`).

It is compiled with the machine's C++ compiler through `torch.utils.cpp_extension` (for this
CPU: `-O3 -march=native`) into torch's extension cache (`TORCH_EXTENSIONS_DIR`, by default
`~/.cache/torch_extensions`), once per machine and source version (about 20 s); later
processes load the cached library in a fraction of a second. `make cpu-kernel` (a step of
`make test` and `make demo`) builds it ahead of time. Without a compiler, or with
`ROLLOUT_ENGINE_CPU_KERNEL=0`, the engine keeps the torch attention path: same results,
slower decode.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("paged_attention_cpu.cpp", "fused_ops_cpu.cpp", "batch_invariant_cpu.cpp",
                        "batch_invariant_attention_cpu.cpp", "lora_cpu.cpp", "moe_experts_cpu.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / name
           for name in ("cpu_vec.h", "batch_invariant_vec.h", "batch_invariant_amx.h",
                        "batch_invariant_dpbf16.h", "batch_invariant_gemm.h")]
CFLAGS = ("-O3", "-march=native", "-fopenmp")
"""The compiler flags of the build (torch's extension builder adds its own, `-std=c++20`
among them)."""
_NAME = "rollout_engine_cpu_attention"
_ENV = "ROLLOUT_ENGINE_CPU_KERNEL"
_lock = threading.Lock()
_state: dict[str, bool] = {}


def enabled() -> bool:
    """Whether the compiled kernel should be used (the switch, not whether it built)."""
    return os.environ.get(_ENV, "1") != "0"


def available() -> bool:
    """Whether the kernel is switched on and built (or loaded: once per process; a failed build
    logs one warning and leaves the torch path). The switch is read at every call, so setting
    the variable takes effect at the next step."""
    if not enabled():
        return False
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                _state["ok"] = _load()
    return _state["ok"]


def _load() -> bool:
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            # One build directory per version of the sources and headers: torch keeps one
            # directory per name and rebuilds in place when the sources change, so two checkouts
            # (or a test run beside an edit) would overwrite each other's library.
            name=f"{_NAME}_{_digest()}",
            sources=[str(source) for source in SOURCES],
            extra_cflags=list(CFLAGS),
            # at::parallel_for is OpenMP inlined from the headers: link the libgomp torch loaded.
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure leaves the torch path in place
        logger.warning("compiled CPU attention unavailable, using the torch path: %s", exc)
        return False
    return hasattr(torch.ops.rollout_cpu, "paged_attention_short")


def _digest() -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))).hexdigest()[:12]


def paged_attention_short(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    members: torch.Tensor,
    group_starts: torch.Tensor,
    group_shared: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attention of the requests in `members` (each with a few query tokens) into `out`
    ([T, H, value_head_dim]), in place.

    Group g is `members[group_starts[g]:group_starts[g + 1]]`; its first `group_shared[g]`
    blocks are the same in every member and end before any member's first query token. Same
    contract as `paged_attention_ref` for those requests (`sliding_window`, `softcap` and
    `sinks` ([num_heads], any float dtype) included); see the C++ source.
    """
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    torch.ops.rollout_cpu.paged_attention_short(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, members,
        group_starts, group_shared, float(scale), int(sliding_window or 0), out,
        float(softcap or 0.0), sinks,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             invariant: bool = False) -> torch.Tensor:
    """Hugging Face's RMSNorm of x's rows ([..., n], a unit stride on n; weight [n] of x's
    dtype) as a new contiguous tensor (see `fused_ops_cpu.cpp` for the rounding). `invariant`:
    the sum of squares in the batch-invariant order (`invariant_mean`'s), so that the result
    equals the torch ops' under `rollout_engine.batch_invariant`'s mode bit for bit."""
    return torch.ops.rollout_cpu.rms_norm(x, weight, float(eps), invariant)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, invariant: bool = False) -> None:
    """In place: residual = x + residual, then x = rms_norm(residual) (both contiguous, one
    shape and dtype)."""
    torch.ops.rollout_cpu.add_rms_norm(x, residual, weight, float(eps), invariant)


def rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
           positions: torch.Tensor) -> None:
    """In place: q [T, Hq, D] and k [T, Hk, D] rotated (rotate-half form) by the float32 table
    cos_sin [2, P, D] at positions [T] (int64)."""
    torch.ops.rollout_cpu.rotary(q, k, cos_sin, positions)


def silu_and_mul(gate_up: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """gate_up [..., 2 I] (gate | up) -> silu(gate) * up [..., I]; `invariant`: silu as
    `invariant_silu` computes it."""
    return torch.ops.rollout_cpu.silu_and_mul(gate_up, invariant)


def invariant_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean of each row of x ([..., n], a unit stride on n; float32, bfloat16 or float16)
    -> [...], summed in one order fixed by n (batch invariance; see `fused_ops_cpu.cpp`)."""
    return torch.ops.rollout_cpu.invariant_mean(x)


def invariant_silu(x: torch.Tensor) -> torch.Tensor:
    """silu(x) elementwise with an exp of fixed steps (batch invariance; see
    `fused_ops_cpu.cpp`)."""
    return torch.ops.rollout_cpu.invariant_silu(x)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key [T, Hkv, Dk] and value [T, Hkv, Dv] into their slots (slot_mapping [T], int64) of the
    caches ([num_blocks, block_size, Hkv, D], any strides but a unit one on D), in place."""
    torch.ops.rollout_cpu.store_kv(key, value, key_cache, value_cache, slot_mapping)


def lora_add(x: torch.Tensor, a: torch.Tensor, bt: list[torch.Tensor], outs: list[torch.Tensor],
             rows: torch.Tensor, group_offsets: torch.Tensor, group_slots: torch.Tensor,
             linear_blocks: torch.Tensor, ranks: torch.Tensor) -> None:
    """LoRA deltas added in place: for each group g of token rows (`rows[group_offsets[g]:
    group_offsets[g + 1]]`, each row in one group at most) under slot `group_slots[g]`, and each
    linear i its slot targets (`linear_blocks[slot, i]` >= 0: its block of A's rows, of
    `ranks[slot]` rows), outs[i][row] += bt[i][slot, :rank].T @ (a[slot, block rows] @ x[row]).
    x [T, in], a [slots, columns, in], bt[i] [slots, max rank, out_i], outs[i] [T, out_i] (unit
    inner strides; one dtype); indexes int64 (see the C++ source)."""
    torch.ops.rollout_cpu.lora_add(x, a, bt, outs, rows, group_offsets, group_slots,
                                   linear_blocks, ranks)


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T + bias with every output in one fixed order, whatever M, the
    row's place and the thread count (see the C++ source); no autograd (see
    `rollout_engine.batch_invariant.linear`)."""
    return torch.ops.rollout_cpu.batch_invariant_linear(x, weight, bias)


def batch_invariant_pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (any strides) in the batch-invariant linear's layout: panels of 16 output
    columns, [ceil(N / 16), K, 16], zeros past N (a copy)."""
    return torch.ops.rollout_cpu.batch_invariant_pack(weight)


def batch_invariant_linear_packed(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`batch_invariant_linear` on a weight packed by `batch_invariant_pack` (the same bits)."""
    return torch.ops.rollout_cpu.batch_invariant_linear_packed(x, packed, int(out_features),
                                                               bias)


def batch_invariant_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              mask: torch.Tensor | None, is_causal: bool,
                              scale: float) -> torch.Tensor:
    """sdpa's layout ([B, H, L, D]; mask bool, true = visible) with every output in one fixed
    order, whatever the batch, the padding or the keys after the query (see the C++ source);
    no autograd (see `rollout_engine.batch_invariant.attention`)."""
    return torch.ops.rollout_cpu.batch_invariant_attention(query, key, value, mask,
                                                           bool(is_causal), float(scale))


def batch_invariant_attention_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  mask: torch.Tensor | None, is_causal: bool,
                                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_invariant_attention`'s output (the same bits) and each query's log-sum-exp of its
    scaled scores ([B, H, Lq] float32; 0 where a query sees no key), as sdpa's flash kernel
    returns them for its backward."""
    return torch.ops.rollout_cpu.batch_invariant_attention_lse(query, key, value, mask,
                                                               bool(is_causal), float(scale))


def batch_invariant_paged_attention(query: torch.Tensor, key_cache: torch.Tensor,
                                    value_cache: torch.Tensor, block_tables: torch.Tensor,
                                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                                    scale: float, sliding_window: int = 0) -> torch.Tensor:
    """Causal attention of a step's tokens ([T, H, D]) over the paged caches with each token's
    bits those the dense batch-invariant attention gives it in a full-sequence forward."""
    return torch.ops.rollout_cpu.batch_invariant_paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, float(scale),
        int(sliding_window))


def moe_pack(weights: torch.Tensor) -> torch.Tensor:
    """Expert weights [E, N, K] in the grouped experts' layout: per expert panels of 16 output
    columns, [E, ceil(N / 16), K, 16], zeros past N (a copy)."""
    return torch.ops.rollout_cpu.moe_pack(weights)


def moe_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    """A mixture-of-experts layer's experts (SiLU-gated, gate|up concatenated) for x [T, H]
    routed to top_k_index [T, k] with top_k_weights [T, k]; gate_up, down from `moe_pack` ->
    [T, H]; every output in a fixed order (see the C++ source)."""
    return torch.ops.rollout_cpu.moe_experts(x, top_k_index, top_k_weights, gate_up, down,
                                             int(intermediate_size))


def moe_grouped_linear(x: torch.Tensor, expert_offsets: torch.Tensor, packed: torch.Tensor,
                       out_features: int) -> torch.Tensor:
    """x [S, K], its rows sorted by expert (expert e's are `expert_offsets[e]` to
    `expert_offsets[e + 1]`), times each row's expert's weight (packed by `moe_pack` from
    [E, out_features, K]) -> [S, out_features]; the grouped experts' GEMM alone."""
    return torch.ops.rollout_cpu.moe_grouped_linear(x, expert_offsets, packed, int(out_features))


def main() -> None:
    """`make cpu-kernel`: build ahead of the tests and servers, and say whether it worked."""
    logging.basicConfig(level=logging.INFO)
    print("compiled CPU attention:", "ready" if available() else "unavailable (torch path)")
