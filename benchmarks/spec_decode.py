"""N-gram speculative decoding vs plain decoding on a copy workload, greedy, side by side.

The model is a tiny llama trained (see `copy_model.py`, cached under
`benchmarks/results/copy_model`) to repeat a span of its prompt, as a code-editing model
repeats most of the file it edits: n-gram drafts from the prompt are then mostly right.
Every batch size runs the same prompts through an engine with speculation on (the
default `disable_by_batch_size`) and one with it off, interleaved, and the greedy outputs
must be token-identical.

    python -m benchmarks.spec_decode                  # batch sizes 1, 4, 16, 64 (about a minute)
    python -m benchmarks.spec_decode --quick          # smaller, for a smoke check
    python -m benchmarks.spec_decode --device cuda    # on a GPU
    # sweeps to choose k and disable_by_batch_size (each is followed by the main table):
    python -m benchmarks.spec_decode --num-prompts 16 --batch-sizes 1 --sweep-k 2 3 4 5 6 8
    python -m benchmarks.spec_decode --num-prompts 16 --sweep-disable 8 16 32 64 128 256
    # GRPO epochs: no drafting, n-gram and suffix drafting (spec_decode_grpo.py)
    python -m benchmarks.spec_decode --grpo --grpo-prompts 16 --grpo-samples 8 --grpo-epochs 3

The first run trains the model (1,500 steps, a few minutes on a CPU) and caches it.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.copy_model import build_copy_model, make_prompt, make_span
from benchmarks.spec_decode_grpo import grpo_table, no_repeats_table
from rollout_engine import LLM, SamplingParams

GOAL_BATCH_1 = 2.0
GOAL_LARGE_BATCH = 0.95
NO_DISABLE = 1 << 20  # a disable_by_batch_size no batch reaches: drafting always on


@dataclass
class Run:
    """One timed `generate` of a batch."""

    elapsed_s: float
    num_tokens: int
    token_ids: list[list[int]]
    spec: dict[str, float]

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="copy model dir (default: train or reuse the cached one)")
    parser.add_argument("--cache-dir", default=str(Path(__file__).parent / "results" / "copy_model"))
    parser.add_argument("--train-steps", type=int, default=None, help="override the training length")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    parser.add_argument("--min-span", type=int, default=48, help="shortest span to copy (tokens)")
    parser.add_argument("--max-span", type=int, default=64, help="longest span to copy (tokens)")
    parser.add_argument("--num-prompts", type=int, default=64,
                        help="prompts per batch size, run `batch` at a time")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system; best is kept")
    parser.add_argument("--sweep-k", type=int, nargs="*", default=[], help="k values to try at batch 1")
    parser.add_argument("--sweep-disable", type=int, nargs="*", default=[],
                        help="batch sizes at which to time drafting forced on vs off")
    parser.add_argument("--quick", action="store_true", help="batch sizes 1, 4, 64, one repeat")
    parser.add_argument("--grpo", action="store_true",
                        help="the GRPO multi-epoch workload instead (spec_decode_grpo.py)")
    parser.add_argument("--grpo-prompts", type=int, default=16)
    parser.add_argument("--grpo-samples", type=int, default=8)
    parser.add_argument("--grpo-epochs", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (0: torch's default); the model is tiny and one thread "
                             "avoids OpenMP stalls on a busy machine")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.batch_sizes, args.num_prompts, args.repeats = [1, 4, 64], 16, 1
    return args


def make_prompts(num_prompts: int, args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [make_prompt(make_span(rng, rng.randint(args.min_span, args.max_span)))
            for _ in range(num_prompts)]


def make_llm(model_dir: str, args: argparse.Namespace, **spec_options: int) -> LLM:
    return LLM(model_dir, device=args.device, kv_cache_bytes=128 * 1024**2,
               max_num_seqs=max([*args.batch_sizes, *args.sweep_disable]), **spec_options)


def timed_run(llm: LLM, prompts: list[list[int]], batch_size: int) -> Run:
    """Greedy `generate` of `prompts`, `batch_size` at a time; each output copies its span
    and stops (at most span + EOS tokens)."""
    llm.reset_prefix_cache()  # every run prefills its prompts in full
    before = llm.stats()
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        params = [SamplingParams(temperature=0.0, max_tokens=len(p) - 1) for p in batch]
        outputs += llm.generate(batch, params)
    elapsed_s = time.perf_counter() - start
    after = llm.stats()
    token_ids = [out.outputs[0].token_ids for out in outputs]
    spec = {k: after[k] - before[k] for k in after if k.startswith("spec_num_")}
    return Run(elapsed_s, sum(len(t) for t in token_ids), token_ids, spec)


def best_of(
    llms: dict[str, LLM], batch_size: int, args: argparse.Namespace
) -> dict[str, Run]:
    """Interleaved runs, so both systems see the same machine load; the fastest is kept."""
    prompts = make_prompts(max(batch_size, args.num_prompts), args)
    runs: dict[str, list[Run]] = {name: [] for name in llms}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            runs[name].append(timed_run(llm, prompts, batch_size))
    return {name: min(rs, key=lambda r: r.elapsed_s) for name, rs in runs.items()}


def check_identical(batch_size: int, off: Run, on: Run) -> str:
    """A check mark, or exit loudly with the first prompt whose outputs differ."""
    for i, (a, b) in enumerate(zip(off.token_ids, on.token_ids)):
        if a != b:
            sys.exit(f"FAIL: batch {batch_size}, prompt {i}: greedy outputs differ\n"
                     f"  off: {a}\n  on:  {b}")
    return "✓"


def acceptance(spec: dict[str, float]) -> tuple[float, float]:
    """Acceptance rate and mean accepted length (accepted drafts + 1 per drafting step)."""
    num_drafts, num_steps = spec["spec_num_drafts"], spec["spec_num_draft_steps"]
    rate = spec["spec_num_accepted_tokens"] / num_drafts if num_drafts else 0.0
    length = 1 + spec["spec_num_accepted_tokens"] / num_steps if num_steps else 0.0
    return rate, length


def goal(batch_size: int, speed_up: float, threshold: int) -> str:
    if batch_size == 1:
        return f">= {GOAL_BATCH_1:.0f}x: {'met' if speed_up >= GOAL_BATCH_1 else 'MISSED'}"
    if batch_size > threshold:
        return f">= {GOAL_LARGE_BATCH}x: {'met' if speed_up >= GOAL_LARGE_BATCH else 'MISSED'}"
    return ""


def main_table(model_dir: str, args: argparse.Namespace) -> None:
    k = args.num_speculative_tokens
    llms = {"off": make_llm(model_dir, args), "on": make_llm(model_dir, args, num_speculative_tokens=k)}
    threshold = llms["on"].engine.config.speculative_config.disable_by_batch_size
    for llm in llms.values():
        timed_run(llm, make_prompts(2, args), 1)  # warm-up
    print(f"\nk = {k}, disable_by_batch_size = {threshold} (default), greedy, "
          f"{args.num_prompts} prompts per batch size, spans of {args.min_span}-{args.max_span} "
          f"tokens, best of {args.repeats}\n")
    print("| batch | tokens | off (tok/s) | on (tok/s) | speed-up | acceptance | mean accepted "
          "length | disabled steps | identical | goal |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---|")
    for batch_size in args.batch_sizes:
        runs = best_of(llms, batch_size, args)
        off, on = runs["off"], runs["on"]
        same = check_identical(batch_size, off, on)
        speed_up = on.tokens_per_s / off.tokens_per_s
        rate, length = acceptance(on.spec)
        print(f"| {batch_size} | {on.num_tokens} | {off.tokens_per_s:.0f} | {on.tokens_per_s:.0f} "
              f"| {speed_up:.2f}x | {rate:.2f} | {length:.2f} | "
              f"{on.spec['spec_num_disabled_steps']:.0f} | {same} | "
              f"{goal(batch_size, speed_up, threshold)} |", flush=True)


def sweep_k(model_dir: str, args: argparse.Namespace) -> None:
    """Batch-1 speed-up for each k: which number of drafts pays best here."""
    off = make_llm(model_dir, args)
    timed_run(off, make_prompts(2, args), 1)
    print("\n| k | off (tok/s) | on (tok/s) | speed-up | acceptance | mean accepted length |")
    print("|---:|---:|---:|---:|---:|---:|")
    for k in args.sweep_k:
        on = make_llm(model_dir, args, num_speculative_tokens=k)
        timed_run(on, make_prompts(2, args), 1)
        runs = best_of({"off": off, "on": on}, 1, args)
        check_identical(1, runs["off"], runs["on"])
        rate, length = acceptance(runs["on"].spec)
        speed_up = runs["on"].tokens_per_s / runs["off"].tokens_per_s
        print(f"| {k} | {runs['off'].tokens_per_s:.0f} | {runs['on'].tokens_per_s:.0f} "
              f"| {speed_up:.2f}x | {rate:.2f} | {length:.2f} |", flush=True)


def sweep_disable(model_dir: str, args: argparse.Namespace) -> None:
    """Drafting forced on vs off per batch size: where it stops paying is the threshold.

    "step cost" is the time of a verification step relative to a plain one (per request):
    drafting pays while the mean accepted length exceeds it, whatever the workload.
    """
    k = args.num_speculative_tokens
    llms = {"off": make_llm(model_dir, args),
            "on": make_llm(model_dir, args, num_speculative_tokens=k, disable_by_batch_size=NO_DISABLE)}
    for llm in llms.values():
        timed_run(llm, make_prompts(2, args), 1)
    print(f"\ndrafting forced on (k = {k}):\n")
    print("| batch | off (tok/s) | on (tok/s) | speed-up | mean accepted length | step cost on/off |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch_size in args.sweep_disable:
        runs = best_of(llms, batch_size, args)
        check_identical(batch_size, runs["off"], runs["on"])
        speed_up = runs["on"].tokens_per_s / runs["off"].tokens_per_s
        length = acceptance(runs["on"].spec)[1]
        print(f"| {batch_size} | {runs['off'].tokens_per_s:.0f} | {runs['on'].tokens_per_s:.0f} "
              f"| {speed_up:.2f}x | {length:.2f} | {length / speed_up:.2f}x |", flush=True)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.grpo:
        start = time.perf_counter()
        grpo_table(args)
        no_repeats_table(args)
        print(f"\ntotal {time.perf_counter() - start:.0f} s")
        return
    model_dir = args.model or str(build_copy_model(args.cache_dir, args.train_steps, args.seed))
    print(f"model: {model_dir}, device {args.device}, {torch.get_num_threads()} threads")
    start = time.perf_counter()
    if args.sweep_k:
        sweep_k(model_dir, args)
    if args.sweep_disable:
        sweep_disable(model_dir, args)
    main_table(model_dir, args)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
