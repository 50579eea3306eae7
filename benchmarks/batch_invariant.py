"""The batch-invariant linear layer against torch's (MKL / oneDNN) at RL batch sizes.

For each weight shape of the `small` preset's decoder (q/k/v/o, gate/up, down, LM head) and each
number of rows (a decode step's batch: 1, 16, 64, 256), the time of one linear layer and its
GFLOP/s, fp32 and bf16, and how many rows of the torch result change when the row is computed
alone instead of inside the batch (the batch-invariant one: 0 by construction, checked here too).

    python -m benchmarks.batch_invariant
    python -m benchmarks.batch_invariant --threads 2 --repeats 50
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from rollout_engine.batch_invariant import linear

# (name, N, K) of the `small` preset (hidden 512, intermediate 1536, vocab 2048).
SHAPES = [("qkv", 1024, 512), ("o", 512, 512), ("gate_up", 3072, 512), ("down", 512, 1536),
          ("lm_head", 2048, 512)]
ROWS = (1, 16, 64, 256)


def seconds_per_call(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def rows_that_change(fn, x: torch.Tensor, weight: torch.Tensor) -> int:
    """Rows whose bits differ when computed alone instead of in the batch."""
    batch = fn(x, weight)
    return sum(not torch.equal(fn(x[i:i + 1], weight), batch[i:i + 1]) for i in range(len(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}; time per call, GFLOP/s, rows that change alone vs batched")
    print("| dtype | layer | rows | torch ms | invariant ms | invariant / torch | torch GFLOP/s "
          "| invariant GFLOP/s | torch rows changed | invariant rows changed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    totals: dict[torch.dtype, list[float]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, n, k in SHAPES:
            weight = torch.randn(n, k).to(dtype)
            for m in ROWS:
                x = torch.randn(m, k).to(dtype)
                plain = seconds_per_call(lambda: F.linear(x, weight), args.repeats)  # noqa: B023
                ours = seconds_per_call(lambda: linear(x, weight), args.repeats)  # noqa: B023
                flops = 2 * m * n * k
                totals.setdefault(dtype, [0.0, 0.0])
                totals[dtype][0] += plain
                totals[dtype][1] += ours
                print(f"| {str(dtype)[6:]} | {name} | {m} | {plain * 1e3:.3f} | {ours * 1e3:.3f} "
                      f"| {ours / plain:.2f}x | {flops / plain / 1e9:.1f} | "
                      f"{flops / ours / 1e9:.1f} | {rows_that_change(F.linear, x, weight)} | "
                      f"{rows_that_change(linear, x, weight)} |")
    for dtype, (plain, ours) in totals.items():
        print(f"{str(dtype)[6:]}: all shapes and batch sizes together, invariant / torch "
              f"{ours / plain:.2f}x")


if __name__ == "__main__":
    main()
