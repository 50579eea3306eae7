"""One decode attention call on the CPU: ms per call and the KV bandwidth it reaches.

A GRPO decode step of the `small` model's attention (8 query heads, 4 KV heads, head_dim 64,
float32 cache (`--dtype`), 16-token blocks (`--block-size`), stored heads-major as the engine
stores it on the CPU): 8 prompts x 8 samples, each prompt 64-256 tokens whose full blocks its
samples share, then each sample's own generated tokens up to the context. The pool's free queue
starts shuffled (a pool that has served earlier batches) and hands out blocks in the engine's
order: each group's prompt blocks, then one block per sample in turn as their generations cross
a block edge. The blocks come from the engine's `BlockPool`, which keeps a request's blocks in
runs of consecutive ids where it can; `--placement scattered` takes the queue's head every time
instead, so a sample's own blocks lie far apart (the pool before it allocated runs; the figures
recorded before 2026-12-07 used that placement). The call goes through `kernels.dispatch`, the
model's entry point, with the step's plan built once (as every layer after the first finds it);
`first ms` is the step's first call, which builds the plan. Each call reads the next of several
layers' caches, so the KV comes from memory as in a real step, not from the last call's L3.

GB/s counts each KV byte the step needs once: the shared prompt blocks once per group, the
own tokens once per sample, keys and values. `of read` sets it against the machine's plain read
bandwidth (a sum over 512 MB, measured at the start with the CPU's vector features): decode
attention only reads, so that is its roof.

    python -m benchmarks.cpu_attention                      # contexts 256, 1024, 4096
    python -m benchmarks.cpu_attention --contexts 1024 --threads 2 --seconds 5
    python -m benchmarks.cpu_attention --softcap 50 --sinks  # a Gemma 2 / gpt-oss layer
    python -m benchmarks.cpu_attention --contexts 192 256 --compare-lanes 12  # lanes vs tiles
    python -m benchmarks.cpu_attention --placement engine scattered  # runs vs scattered blocks

`--vllm` also times vLLM's CPU attention kernel (`make peers`) on each step: the same block
tables in its own cache layout (a block's keys, then its values), float32, in its venv. vLLM's
CPU default is 128-token blocks (`--block-size 16 128`); it takes its 16-lane path for block
sizes that are not a multiple of 32.

`--compare-lanes R` times the kernel with a group's shared prompt blocks on its tiles (the
query heads of one token at a time) against its lanes path (sixteen samples' vectors at a
time), alternating R rounds in one process.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from benchmarks.common import run_vllm_script, vllm_available, vllm_missing_note
from benchmarks.roofline import cpu_description, peak_read_bandwidth
from kernels import AttentionMetadata, cpu_extension, kv_cache_layout
from kernels.dispatch import paged_attention
from rollout_engine.core.block_pool import BlockPool

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 4, 64
NUM_PROMPTS, SAMPLES = 8, 8
LANES_ENV = "ROLLOUT_ENGINE_CPU_ATTN_LANES"  # 0: a group's shared blocks on the tiles
_VLLM_KERNEL_SCRIPT = Path(__file__).resolve().parent / "peers" / "vllm_attention.py"
# Enough layers that one call's KV is out of L3 before the next call on that layer.
MIN_CACHE_BYTES, MAX_LAYERS = 256 << 20, 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed calls per context")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, nargs="+", default=[16],
                        help="KV block sizes (tokens), one run each")
    parser.add_argument("--placement", nargs="+", default=["engine"],
                        choices=["engine", "scattered"],
                        help="where a sample's blocks lie: the engine's runs of consecutive ids"
                             " or scattered (the engine before it allocated runs); one run each")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="query, cache and output dtype")
    parser.add_argument("--softcap", type=float, default=None,
                        help="logit softcap c: scores become c * tanh(s / c) (Gemma 2: 50)")
    parser.add_argument("--sinks", action="store_true",
                        help="one sink logit per query head (gpt-oss)")
    parser.add_argument("--vllm", action="store_true",
                        help="also time vLLM's CPU kernel on each step (`make peers`; float32, "
                             "no softcap or sinks)")
    parser.add_argument("--compare-lanes", type=int, default=0, metavar="ROUNDS",
                        help="time the shared blocks on the tiles against the lanes path, "
                             "alternating ROUNDS rounds in this process")
    return parser.parse_args()


def make_step(context: int, seed: int = 0, block_size: int = 16, elem_bytes: int = 4,
              placement: str = "engine"):
    """One decode step with every sample at `context` tokens: (metadata, pool size, KV bytes)."""
    rng = random.Random(seed)
    prompt_lens = [min(rng.randint(64, 256), context - 1) for _ in range(NUM_PROMPTS)]
    shared_blocks = [p // block_size for p in prompt_lens]  # only full blocks are shared
    total_blocks = -(-context // block_size)
    needed = sum(s + SAMPLES * (total_blocks - s) for s in shared_blocks)
    pool = needed + needed // 10
    take = block_taker(pool, rng, placement)
    tables = []
    for s in shared_blocks:
        prefix = []
        for _ in range(s):
            prefix.append(take(prefix))
        tables += [list(prefix) for _ in range(SAMPLES)]
    # Then each sample's own blocks (the prompt's partial block first), one per sample in turn
    # as the step's tokens cross each block edge.
    for block in range(min(shared_blocks), total_blocks):
        for table in tables:
            if len(table) == block:
                table.append(take(table))
    metadata = AttentionMetadata.build([1] * len(tables), [context] * len(tables), tables,
                                       block_size)
    kv_tokens = sum(s * block_size + SAMPLES * (context - s * block_size) for s in shared_blocks)
    return metadata, pool, kv_tokens * NUM_KV_HEADS * HEAD_DIM * elem_bytes * 2


def block_taker(num_blocks: int, rng: random.Random, placement: str):
    """`take(table)`: the id of the next block of the request whose blocks so far are `table`,
    from a pool of `num_blocks` whose free queue is in a random order (it served earlier
    batches). "engine": the engine's `BlockPool`, which continues a request's run of
    consecutive ids where it can; "scattered": always the queue's head, so a sample's blocks
    lie far apart (the engine before it allocated runs)."""
    order = list(range(num_blocks))
    rng.shuffle(order)
    if placement == "scattered":
        order.reverse()  # pop() takes the queue's head
        return lambda table: order.pop()
    pool = BlockPool(num_blocks, enable_caching=False)
    blocks = pool.allocate(num_blocks)
    pool.free([blocks[i] for i in order])  # the free queue in that order
    return lambda table: pool.allocate(1, after=table[-1] if table else None)[0].block_id


def make_caches(num_blocks: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Several layers' caches, stored heads-major like the engine's CPU cache:
    [layers, 2, num_blocks, bs, Hkv, D]."""
    layer_bytes = 2 * num_blocks * block_size * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    num_layers = max(2, min(MAX_LAYERS, -(-MIN_CACHE_BYTES // layer_bytes)))
    layout = kv_cache_layout(torch.device("cpu"))
    storage = torch.randn(layout.storage_shape(num_layers, num_blocks, block_size, NUM_KV_HEADS,
                                               HEAD_DIM), dtype=dtype)
    return layout.logical_view(storage)


class Step:
    """One decode step's attention over several layers' caches, its plan built once."""

    def __init__(self, context: int, seed: int, softcap: float | None, sinks: bool,
                 block_size: int, dtype: torch.dtype, placement: str = "engine"):
        self.metadata, self.num_blocks, self.kv_bytes = make_step(context, seed, block_size,
                                                                  dtype.itemsize, placement)
        self.context, self.block_size = context, block_size
        self.caches = make_caches(self.num_blocks, block_size, dtype)
        self.query = torch.randn(self.metadata.num_reqs, NUM_HEADS, HEAD_DIM, dtype=dtype)
        self.options = {"softcap": softcap, "sinks": torch.randn(NUM_HEADS) if sinks else None}
        self.layer = 0
        start = time.perf_counter()
        self.call()  # builds the plan
        self.plan_ms = (time.perf_counter() - start) * 1e3

    def call(self) -> float:
        """One call on the next layer's caches (so the KV comes from memory): its seconds."""
        self.layer = (self.layer + 1) % self.caches.shape[0]
        start = time.perf_counter()
        paged_attention(self.query, self.caches[self.layer, 0], self.caches[self.layer, 1],
                        self.metadata, HEAD_DIM**-0.5, **self.options)
        return time.perf_counter() - start


def run(step: Step, seconds: float) -> dict:
    """Calls of `step` for `seconds` (at least 10): the median and what it reads."""
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 10:
        times.append(step.call())
    ms = statistics.median(times) * 1e3
    return {"context": step.context, "ms": ms, "gbps": step.kv_bytes / ms / 1e6,
            "mb": step.kv_bytes / 1e6, "plan_ms": step.plan_ms, "calls": len(times),
            "layers": step.caches.shape[0]}


def run_vllm_kernel(step: Step, seconds: float, threads: int) -> dict:
    """vLLM's CPU attention kernel on the same step (the same block tables, its own cache
    layout, float32), in its venv: {"ms": median ms per call, "isa": its vector path, ...}."""
    job = {"block_tables": step.metadata.block_tables.tolist(), "context": step.context,
           "block_size": step.block_size, "num_blocks": step.num_blocks,
           "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
           "threads": threads, "seconds": seconds, "min_cache_bytes": MIN_CACHE_BYTES,
           "max_layers": MAX_LAYERS}
    return run_vllm_script(_VLLM_KERNEL_SCRIPT, job, timeout_s=600)


def compare_lanes(context: int, rounds: int, seed: int, softcap: float | None = None,
                  sinks: bool = False, block_size: int = 16,
                  dtype: torch.dtype = torch.float32, placement: str = "engine") -> dict:
    """The kernel with its shared blocks on the tiles (ROLLOUT_ENGINE_CPU_ATTN_LANES=0) and on
    the lanes, alternating rounds of 15 calls in one process: each one's median round (ms)."""
    step = Step(context, seed, softcap, sinks, block_size, dtype, placement)
    rounds_ms: dict[str, list[float]] = {"0": [], "1": []}
    with mock.patch.dict(os.environ):  # the switch as it was afterwards
        for r in range(rounds):
            for switch in ("0", "1") if r % 2 == 0 else ("1", "0"):
                os.environ[LANES_ENV] = switch
                rounds_ms[switch].append(statistics.median(step.call() for _ in range(15)) * 1e3)
    return {"context": context, "tiles": statistics.median(rounds_ms["0"]),
            "lanes": statistics.median(rounds_ms["1"])}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_extension.available():
        print("note: the compiled kernel is unavailable; timing the torch path")
    features = "".join([f", softcap {args.softcap:g}" if args.softcap else "",
                        ", sinks" if args.sinks else ""])
    print(f"{NUM_PROMPTS} prompts x {SAMPLES} samples, {NUM_HEADS} heads / {NUM_KV_HEADS} KV heads,"
          f" head_dim {HEAD_DIM}, {args.dtype}, {args.threads} threads{features}")
    dtype = getattr(torch, args.dtype)
    runs = itertools.product(args.placement, args.block_size, args.contexts)
    if args.compare_lanes:
        print(f"{'placement':>10} {'block':>6} {'context':>8} {'tiles ms':>9} {'lanes ms':>9}"
              f" {'lanes / tiles':>14}")
        for placement, block_size, context in runs:
            r = compare_lanes(context, args.compare_lanes, args.seed, args.softcap,
                              args.sinks, block_size, dtype, placement)
            print(f"{placement:>10} {block_size:>6} {context:>8} {r['tiles']:>9.3f}"
                  f" {r['lanes']:>9.3f} {r['lanes'] / r['tiles']:>13.2f}x")
        return
    with_vllm = args.vllm and vllm_available()
    if args.vllm and not with_vllm:
        print(vllm_missing_note())
    if with_vllm and (args.dtype != "float32" or args.softcap or args.sinks):
        print("note: vLLM's kernel is timed on float32 steps without softcap or sinks only")
        with_vllm = False
    vllm_header = f" {'vLLM ms':>8} {'vLLM / ours':>12}" if with_vllm else ""
    read_gbps = peak_read_bandwidth() / 1e9
    print(f"{cpu_description()}\nplain read: {read_gbps:.1f} GB/s")
    print(f"{'placement':>10} {'block':>6} {'context':>8} {'ms/call':>9} {'GB/s':>7}"
          f" {'of read':>8} {'KV MB':>8} {'first ms':>9} {'calls':>6}{vllm_header}")
    for placement, block_size, context in runs:
        step = Step(context, args.seed, args.softcap, args.sinks, block_size, dtype, placement)
        r = run(step, args.seconds)
        theirs = ""
        if with_vllm:
            try:
                vllm_ms = run_vllm_kernel(step, args.seconds, args.threads)["ms"]
                theirs = f" {vllm_ms:>8.3f} {vllm_ms / r['ms']:>11.2f}x"
            except RuntimeError as exc:
                theirs = f" vLLM failed: {str(exc).splitlines()[-1]}"
        del step  # its caches go before the next step's are made
        print(f"{placement:>10} {block_size:>6} {r['context']:>8} {r['ms']:>9.3f}"
              f" {r['gbps']:>7.1f} {r['gbps'] / read_gbps:>8.0%} {r['mb']:>8.1f}"
              f" {r['plan_ms']:>9.2f} {r['calls']:>6}{theirs}")


if __name__ == "__main__":
    main()
