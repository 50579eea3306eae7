"""Async scheduling against the synchronous loop: GRPO rollouts, same engine, same run.

Under async scheduling step N+1 is scheduled and its inputs built while step N computes (on
a GPU the forward runs on the engine's forward thread; on the CPU on the caller's, and the
scheduling on the engine's host thread). The table reports, per batch size:

- tokens/s of each loop, and the speed-up;
- device time per step: forward + sampling (`Worker.run_model`);
- host time per step: the rest of the wall time. Synchronous, it is all exposed; async, what
  remains exposed is what the overlap did not hide ("hidden" = 1 - async / sync);
- bound: the speed-up a perfect overlap would give, the sync step over its device time.

    python -m benchmarks.async_scheduling                       # small model, batches 1 16 64
    python -m benchmarks.async_scheduling --size tiny --max-tokens 64

On the CPU the forward and the host share the GIL: only time spent inside torch ops (which
release it) overlaps. `--switch-interval` shortens the interpreter's GIL hand-off so the
forward gets the GIL back quickly after each op.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import add_model_args
from rollout_engine import LLM, SamplingParams
from rollout_engine.tiny_model import build_tiny_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64],
                        help="sequences per rollout (prompts x n, n = 8 from 8 up)")
    parser.add_argument("--min-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per loop")
    parser.add_argument("--cpu-threads", type=int, help="forward threads (default: engine's)")
    parser.add_argument("--switch-interval", type=float,
                        help="sys.setswitchinterval for this run (default: Python's 5 ms)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


@dataclass
class Measurement:
    elapsed_s: float = 0.0
    device_s: float = 0.0
    num_steps: int = 0
    num_tokens: int = 0

    def add(self, other: Measurement) -> None:
        self.elapsed_s += other.elapsed_s
        self.device_s += other.device_s
        self.num_steps += other.num_steps
        self.num_tokens += other.num_tokens

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s

    @property
    def device_ms_per_step(self) -> float:
        return 1e3 * self.device_s / self.num_steps

    @property
    def host_ms_per_step(self) -> float:
        return 1e3 * (self.elapsed_s - self.device_s) / self.num_steps


def rollout(model_dir: str, prompts, params, args, async_scheduling: bool) -> Measurement:
    llm = LLM(model_dir, async_scheduling=async_scheduling, cpu_threads=args.cpu_threads,
              device=args.device, max_num_seqs=max(256, len(prompts) * params.n),
              max_num_batched_tokens=2048, kv_cache_bytes=1 << 30)
    try:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
        worker, measurement = llm.engine.worker, Measurement()
        run_model = worker.run_model

        def timed_run_model(prepared):
            start = time.perf_counter()
            try:
                return run_model(prepared)
            finally:
                measurement.device_s += time.perf_counter() - start
                measurement.num_steps += 1

        worker.run_model = timed_run_model
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        measurement.elapsed_s = time.perf_counter() - start
        measurement.num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return measurement
    finally:
        llm.engine.shutdown()


def main() -> None:
    args = parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_model(Path(tmp) / "model", args.arch, args.size))
        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
        rows = []
        for batch in args.batch_sizes:
            n = min(8, batch)
            prompts = [
                [rng.randrange(3, vocab_size)
                 for _ in range(rng.randint(args.min_prompt_len, args.max_prompt_len))]
                for _ in range(batch // n)
            ]
            params = SamplingParams(n=n, temperature=1.0, max_tokens=args.max_tokens,
                                    ignore_eos=True, seed=args.seed)
            totals = {False: Measurement(), True: Measurement()}
            for _ in range(args.repeats):  # alternate, so drifting load hits both alike
                for async_scheduling in (False, True):
                    totals[async_scheduling].add(
                        rollout(model_dir, prompts, params, args, async_scheduling)
                    )
            rows.append((batch, totals[False], totals[True]))
            sync, async_ = totals[False], totals[True]
            print(f"batch {batch}: sync {sync.tokens_per_s:.0f} tok/s, async "
                  f"{async_.tokens_per_s:.0f} tok/s", flush=True)
    print(f"\n{args.size} {args.arch}, {args.max_tokens} new tokens, T=1, "
          f"{args.repeats} alternating runs per loop, cpu_threads={args.cpu_threads or 'auto'}, "
          f"switch interval {sys.getswitchinterval() * 1e3:g} ms\n")
    print("| batch | loop | tokens/s | device ms/step | host ms/step | host hidden | speed-up "
          "| bound |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for batch, sync, async_ in rows:
        hidden = 1 - async_.host_ms_per_step / sync.host_ms_per_step
        speedup = async_.tokens_per_s / sync.tokens_per_s
        bound = 1 + sync.host_ms_per_step / sync.device_ms_per_step
        print(f"| {batch} | sync | {sync.tokens_per_s:.0f} | {sync.device_ms_per_step:.2f} | "
              f"{sync.host_ms_per_step:.2f} | | 1.00x | |")
        print(f"| {batch} | async | {async_.tokens_per_s:.0f} | {async_.device_ms_per_step:.2f} | "
              f"{async_.host_ms_per_step:.2f} | {hidden:.0%} | {speedup:.2f}x | {bound:.2f}x |")


if __name__ == "__main__":
    main()
