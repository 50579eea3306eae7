"""Structured outputs: step time with a grammar constraint against without, same engine, same run.

Each constrained request carries a regex that never completes within `--max-tokens`
(`[a-z ,.]+`) or a JSON Schema with a long free string, so constrained and free completions
generate the same number of tokens, and per-step times compare like for like. The grammar
bitmask of a step is computed on the host while its forward runs on the engine's forward
thread; the table reports how long that takes per step and how much of it shows in the step
time ("hidden" = 1 - extra step time / mask time).

    python -m benchmarks.structured_output                    # small model, batches 1 16 64
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import add_model_args
from rollout_engine import LLM, SamplingParams, StructuredOutputsParams
from rollout_engine.tiny_model import build_tiny_model

CONSTRAINTS = {
    "regex": StructuredOutputsParams(regex=r"[a-z ,.]+"),
    "json": StructuredOutputsParams(json={
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
    }),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--constraint", choices=list(CONSTRAINTS), default="regex")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per mode")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


@dataclass
class Run:
    elapsed_s: float = 0.0
    mask_s: float = 0.0
    num_steps: int = 0
    num_tokens: int = 0

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.elapsed_s / self.num_steps


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> Run:
    result = Run()
    engine = llm.engine
    step = engine.step

    def counted_step():
        result.num_steps += 1
        return step()

    engine.step = counted_step
    compiler = engine._grammars()
    bitmask = compiler.bitmask

    def timed_bitmask(rows):
        start = time.perf_counter()
        try:
            return bitmask(rows)
        finally:
            result.mask_s += time.perf_counter() - start

    compiler.bitmask = timed_bitmask
    try:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        result.elapsed_s = time.perf_counter() - start
    finally:
        engine.step, compiler.bitmask = step, bitmask
    result.num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return result


def main() -> None:
    args = parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_model(Path(tmp) / "model", args.arch, args.size))
        llm = LLM(model_dir, device=args.device, max_num_seqs=256, kv_cache_bytes=1 << 30)
        words = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with",
                 "as", "by", "at", "it", "from"]
        rows = []
        for batch in args.batch_sizes:
            prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))
                       for _ in range(batch)]
            free = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True,
                                  seed=args.seed)
            constrained = SamplingParams(temperature=1.0, max_tokens=args.max_tokens,
                                         ignore_eos=True, seed=args.seed,
                                         structured_outputs=CONSTRAINTS[args.constraint])
            llm.generate(prompts[:1], constrained)  # warm-up, and the grammar compiled once
            totals = {"free": Run(), "constrained": Run()}
            for _ in range(args.repeats):
                for name, params in (("free", free), ("constrained", constrained)):
                    r = run(llm, prompts, params)
                    total = totals[name]
                    total.elapsed_s += r.elapsed_s
                    total.mask_s += r.mask_s
                    total.num_steps += r.num_steps
                    total.num_tokens += r.num_tokens
            rows.append((batch, totals["free"], totals["constrained"]))
            print(f"batch {batch}: free {totals['free'].ms_per_step:.2f} ms/step, constrained "
                  f"{totals['constrained'].ms_per_step:.2f} ms/step", flush=True)
        llm.engine.shutdown()
    print(f"\n{args.size} {args.arch}, {args.constraint} constraint, {args.max_tokens} tokens "
          f"each (ignore_eos), T=1, {args.repeats} alternating runs per mode\n")
    print("| batch | free ms/step | constrained ms/step | overhead | mask ms/step | mask hidden |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch, free, constrained in rows:
        overhead = constrained.ms_per_step / free.ms_per_step - 1
        mask_ms = 1e3 * constrained.mask_s / constrained.num_steps
        hidden = 1 - (constrained.ms_per_step - free.ms_per_step) / mask_ms if mask_ms else 1.0
        print(f"| {batch} | {free.ms_per_step:.2f} | {constrained.ms_per_step:.2f} | "
              f"{overhead:+.1%} | {mask_ms:.2f} | {max(0.0, min(1.0, hidden)):.0%} |")


if __name__ == "__main__":
    main()
