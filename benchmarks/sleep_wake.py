"""Sleep/wake latency of the engine next to the physical floor: memset and memcpy of the same bytes.

W = bytes of the weights pool, K = bytes of the KV pool. Each operation releases memory
and takes it back; the floor is the least work that takes, measured in the same run,
interleaved with the engine's operations, with the same torch threads:

| operation                                            | floor                      |
|------------------------------------------------------|----------------------------|
| sleep(level=1) + wake_up(): W to a host backup and   | 2 x memcpy(W) + memset(K)  |
|   back, K handed back zero-filled                    |                            |
| sleep(level=2) + wake_up(): W and K handed back      | memset(W + K)              |
|   zero-filled                                        |                            |
| release_kv_cache_memory() + wake_up(["kv_cache"])    | memset(K)                  |
| update_weights(every parameter), after level 2       | memcpy(W)                  |

"touched floor": memset/memcpy into resident memory (pure memory bandwidth); the goal is
a ratio of at most 1.5 against it. "fresh floor": the same into freshly allocated memory
(`torch.zeros`, `torch.empty(...).copy_`), i.e. what freeing and re-allocating tensors
costs; memory really given back to the OS has to be zeroed by the kernel again, so on
CPU this is the floor any release-and-reacquire can reach.

On CUDA (`--device cuda`) the floors are the same operations on the device (memset) and
between the device and pinned host memory (memcpy: the backup's direction), and the table
also gives the device bytes each release handed back, from `torch.cuda.mem_get_info`.

    python benchmarks/sleep_wake.py                       # "small" model, 512 MiB KV pool
    python benchmarks/sleep_wake.py --kv-cache-mib 64 --repeats 3   # quick look
    python benchmarks/sleep_wake.py --device cuda --size 0.5b --kv-cache-mib 4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_engine import LLM, SamplingParams
from rollout_engine.tiny_model import build_tiny_model
from rollout_engine.worker.models.loader import iterate_checkpoint

MiB = 1 << 20
GOAL_RATIO = 1.5
Samples = dict[str, float]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="Hugging Face model dir (default: build the 'small' preset)")
    parser.add_argument("--arch", default="llama", help="architecture of the built model")
    parser.add_argument("--size", default="small", help="size preset of the built model")
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9, help="median of this many runs")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads; the work is memory-bound, and one thread avoids OpenMP stalls "
        "on a shared machine",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    return parser.parse_args()


DEVICE = torch.device("cpu")


def timed_s(action: Callable[[], object]) -> float:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    start = time.perf_counter()
    action()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return time.perf_counter() - start


class Floors:
    """memset and memcpy of byte tensors of the pools' sizes, into resident or fresh memory.
    On CUDA memsets run on the device and memcpy goes device -> pinned host."""

    def __init__(self, weights_bytes: int, kv_bytes: int) -> None:
        self.w, self.k = weights_bytes, kv_bytes
        on_device = {"dtype": torch.uint8, "device": DEVICE}
        self.kv = torch.ones(kv_bytes, **on_device)
        self.both = torch.ones(weights_bytes + kv_bytes, **on_device)
        self.src = torch.ones(weights_bytes, **on_device)
        self.dst = torch.zeros(weights_bytes, dtype=torch.uint8,
                               pin_memory=DEVICE.type == "cuda")

    def sample(self) -> Samples:
        on_device = {"dtype": torch.uint8, "device": DEVICE}
        return {
            "memset(K)": timed_s(self.kv.zero_),
            "memset(W+K)": timed_s(self.both.zero_),
            "memcpy(W)": timed_s(lambda: self.dst.copy_(self.src)),
            "fresh memset(K)": timed_s(lambda: torch.zeros(self.k, **on_device)),
            "fresh memset(W+K)": timed_s(lambda: torch.zeros(self.w + self.k, **on_device)),
            "fresh memcpy(W)": timed_s(lambda: torch.empty_like(self.dst).copy_(self.src)),
        }


def sample_engine(llm: LLM, weights: dict[str, torch.Tensor]) -> Samples:
    """Seconds of each release and restore, once; the engine ends awake."""
    return {
        "level 1 release": timed_s(lambda: llm.sleep(level=1)),
        "level 1 restore": timed_s(llm.wake_up),
        "level 2 release": timed_s(lambda: llm.sleep(level=2)),
        "level 2 restore": timed_s(llm.wake_up),
        "update_weights restore": timed_s(lambda: llm.update_weights(weights)),
        "release_kv_cache_memory release": timed_s(llm.release_kv_cache_memory),
        "release_kv_cache_memory restore": timed_s(lambda: llm.wake_up(["kv_cache"])),
    }


def measure(llm: LLM, weights: dict[str, torch.Tensor], repeats: int) -> Samples:
    """Medians of engine operations and floors, interleaved so both see the same load."""
    pool_bytes = llm.memory_state().pool_bytes
    floors = Floors(pool_bytes["weights"], pool_bytes["kv_cache"])
    samples = [{**floors.sample(), **sample_engine(llm, weights)} for _ in range(repeats)]
    return {name: statistics.median(s[name] for s in samples) for name in samples[0]}


def floor_of(name: str, m: Samples, prefix: str) -> float:
    return {
        "level 1": 2 * m[f"{prefix}memcpy(W)"] + m[f"{prefix}memset(K)"],
        "level 2": m[f"{prefix}memset(W+K)"],
        "update_weights": m[f"{prefix}memcpy(W)"],
        "release_kv_cache_memory": m[f"{prefix}memset(K)"],
    }[name]


FLOOR_LABELS = {
    "level 1": "2 x memcpy(W) + memset(K)",
    "level 2": "memset(W+K)",
    "update_weights": "memcpy(W)",
    "release_kv_cache_memory": "memset(K)",
}


def print_table(m: Samples, w: int, k: int) -> None:
    print(f"\nW = {w / MiB:.1f} MiB of weights, K = {k / MiB:.1f} MiB of KV cache, "
          f"{torch.get_num_threads()} torch thread(s), medians\n")
    print("| operation | release (ms) | restore (ms) | total (ms) | floor | touched floor (ms) "
          "| ratio | fresh floor (ms) | ratio |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for name, label in FLOOR_LABELS.items():
        release_s = m.get(f"{name} release", 0.0)
        total_s = release_s + m[f"{name} restore"]
        touched_s, fresh_s = floor_of(name, m, ""), floor_of(name, m, "fresh ")
        verdict = "met" if total_s <= GOAL_RATIO * touched_s else "missed"
        release = f"{release_s * 1e3:.1f}" if f"{name} release" in m else "-"
        print(f"| {name} | {release} | {m[f'{name} restore'] * 1e3:.1f} | {total_s * 1e3:.1f} "
              f"| {label} | {touched_s * 1e3:.1f} | {total_s / touched_s:.2f}x "
              f"(<= {GOAL_RATIO}x {verdict}) | {fresh_s * 1e3:.1f} | {total_s / fresh_s:.2f}x |")


def device_bytes_freed(llm: LLM) -> dict[str, int]:
    """Device bytes each release hands back, from the driver's free-memory count (CUDA)."""
    def freed(release: Callable[[], object], restore: Callable[[], object]) -> int:
        free_before, _ = torch.cuda.mem_get_info(DEVICE)
        release()
        free_after, _ = torch.cuda.mem_get_info(DEVICE)
        restore()
        return free_after - free_before

    return {
        "level 1": freed(lambda: llm.sleep(level=1), llm.wake_up),
        "release_kv_cache_memory": freed(llm.release_kv_cache_memory,
                                         lambda: llm.wake_up(["kv_cache"])),
    }


def main() -> None:
    global DEVICE
    args = parse_args()
    DEVICE = torch.device(args.device)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_model(Path(tmp) / "model", args.arch, args.size))
        dtype = "float32" if DEVICE.type == "cpu" else "bfloat16"
        llm = LLM(model_dir, kv_cache_bytes=args.kv_cache_mib * MiB, device=args.device,
                  dtype=dtype)
        # The checkpoint in process memory (as a trainer holds it), to restore after level 2.
        weights = {name: t.to(getattr(torch, dtype)).clone()
                   for name, t in iterate_checkpoint(model_dir)}
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    sample_engine(llm, weights)  # warm-up of the memory paths
    medians = measure(llm, weights, args.repeats)
    pool_bytes = llm.memory_state().pool_bytes
    print_table(medians, pool_bytes["weights"], pool_bytes["kv_cache"])
    if DEVICE.type == "cuda":
        print("\n| release | pool bytes | device bytes freed (mem_get_info) | freed / pool |")
        print("|---|---:|---:|---:|")
        pools = {"level 1": pool_bytes["weights"] + pool_bytes["kv_cache"],
                 "release_kv_cache_memory": pool_bytes["kv_cache"]}
        for name, freed in device_bytes_freed(llm).items():
            print(f"| {name} | {pools[name] / MiB:.1f} MiB | {freed / MiB:.1f} MiB "
                  f"| {freed / pools[name]:.3f} |")


if __name__ == "__main__":
    main()
