"""Reasoning-length rollouts: a GRPO batch at 256, 1,024 and 4,096 new tokens, our engine side by
side with vLLM's CPU build (when `make peers` installed it) and Hugging Face `generate`.

RL for reasoning generates thousands of tokens per sample. What must not grow with length is
the host's work per step (scheduling, inputs, outputs): this prints, for our engine, the host
milliseconds per step (a step's wall time minus its forward and sampling) and the share of
the step the host takes, next to tokens/s for every system and the cost per token relative
to each system's own at the shortest length.

    python -m benchmarks.long_generation                       # 8 prompts x n=8, small preset
    python -m benchmarks.long_generation --lengths 256 1024    # a quicker look
    python -m benchmarks.long_generation --repeats 3           # best of 3 alternating rounds

EOS is ignored everywhere, so every system generates the same number of tokens; vLLM runs
unseeded (a per-request seed crashes its CPU build). HF `generate` runs up to
`--hf-max-length` new tokens (it is the slowest by far at long lengths). `--repeats R` runs
every system R times per length, rounds in turn, and keeps each one's best run: on a machine
whose speed drifts (a neighbour's load), one run each can put either system 10-25% ahead.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import (
    add_grpo_workload_args,
    add_model_args,
    add_vllm_modes_arg,
    kv_cache_bytes_for,
    left_padded,
    make_prompts,
    run_rounds,
    run_vllm,
    vllm_available,
    vllm_missing_note,
)
from rollout_engine import LLM, SamplingParams
from rollout_engine.tiny_model import build_tiny_model


@dataclass
class Run:
    elapsed_s: float
    num_tokens: int
    host_ms_per_step: float | None = None
    host_share: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    add_grpo_workload_args(parser, max_tokens=0)
    parser.set_defaults(num_prompts=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096],
                        help="new tokens per sample, one run each")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, help="OpenMP threads of every system")
    parser.add_argument("--skip", nargs="*", default=[], choices=["vllm", "hf"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights, activations and KV of every system")
    add_vllm_modes_arg(parser, default=["compiled"])
    parser.add_argument("--block-size", type=int,
                        help="our engine's KV block size (default: the engine's)")
    parser.add_argument("--hf-max-length", type=int, default=1024,
                        help="run HF generate only up to this many new tokens")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of every system per length, alternating; the best is kept")
    return parser.parse_args()


def run_engine(model_dir: str, prompts, args, max_tokens: int) -> Run:
    """A fresh engine; its steps timed, and within each the forward and sampling."""
    num_rows = len(prompts) * args.n
    llm = LLM(model_dir, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=num_rows, max_model_len=args.max_prompt_len + max_tokens + 16,
              kv_cache_bytes=kv_cache_bytes_for(model_dir, num_rows,
                                                args.max_prompt_len + max_tokens),
              cpu_threads=args.threads, dtype=args.dtype,
              **({"block_size": args.block_size} if args.block_size else {}))
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                            seed=args.seed)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    engine = llm.engine
    device_s, num_steps = [0.0], [0]
    run_model, step = engine.worker.run_model, engine.step

    def timed_run_model(prepared):
        start = time.perf_counter()
        try:
            return run_model(prepared)
        finally:
            device_s[0] += time.perf_counter() - start

    def counted_step():
        num_steps[0] += 1
        return step()

    engine.worker.run_model, engine.step = timed_run_model, counted_step
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    engine.shutdown()
    host_s = elapsed - device_s[0]
    return Run(elapsed, sum(len(c.token_ids) for o in outputs for c in o.outputs),
               1e3 * host_s / num_steps[0], host_s / elapsed)


@torch.inference_mode()
def run_hf_generate(model_dir: str, prompts, args, max_tokens: int) -> Run:
    """TRL's default path: one left-padded batch, `num_return_sequences=n`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    input_ids, mask = left_padded(prompts)
    max_len = input_ids.shape[1]
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=max_tokens, num_return_sequences=args.n,
                              eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=mask, generation_config=config)
    return Run(time.perf_counter() - start, (out.shape[1] - max_len) * out.shape[0])


def run_vllm_peer(model_dir: str, prompts, args, max_tokens: int, eager: bool = False) -> Run:
    num_rows = len(prompts) * args.n
    kv_gib = kv_cache_bytes_for(model_dir, num_rows, args.max_prompt_len + max_tokens) / 1024**3
    result = run_vllm(model_dir, prompts, n=args.n, max_tokens=max_tokens,
                      max_model_len=args.max_prompt_len + max_tokens + 16,
                      max_num_batched_tokens=args.max_num_batched_tokens, threads=args.threads,
                      kv_cache_gib=max(1, round(kv_gib + 0.5)), dtype=args.dtype,
                      enforce_eager=eager)
    return Run(result["elapsed_s"][0], result["num_tokens"])


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    longest = args.max_prompt_len + max(args.lengths) + 64
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_model(
            Path(tmp) / "model", args.arch, args.size, max_position_embeddings=longest))
        from transformers import AutoConfig

        prompts = make_prompts(args, AutoConfig.from_pretrained(model_dir).vocab_size)
        print(f"workload: {len(prompts)} prompts x n={args.n}, prompt lengths "
              f"{args.min_prompt_len}-{args.max_prompt_len}, new tokens {args.lengths}, T=1, "
              f"threads: {args.threads or 'each its own policy'}")
        systems = {"rollout_engine": run_engine}
        if "vllm" not in args.skip:
            if vllm_available():
                for mode in args.vllm_modes:
                    systems[f"vLLM (CPU build, {mode})"] = functools.partial(
                        run_vllm_peer, eager=mode == "eager")
            else:
                print(vllm_missing_note())
        if "hf" not in args.skip:
            systems["HF generate (padded)"] = run_hf_generate
        results: dict[tuple[str, int], Run] = {}
        for length in args.lengths:
            runs = {name: functools.partial(run, model_dir, prompts, args, length)
                    for name, run in systems.items()
                    if not (name.startswith("HF") and length > args.hf_max_length)}
            best = run_rounds(runs, args.repeats, elapsed_of=lambda result: result.elapsed_s,
                              label=f", {length} new tokens")
            results.update({(name, length): run for name, run in best.items()})
    print_tables(results, args.lengths)


def print_tables(results: dict[tuple[str, int], Run], lengths: list[int]) -> None:
    print("\n| system | new tokens | time (s) | tokens/s | vs rollout_engine | cost/token vs "
          f"its own at {lengths[0]} | host ms/step | host share |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for (name, length), run in results.items():
        ours = results.get(("rollout_engine", length))
        first = results.get((name, lengths[0]))
        ratio = f"{run.tokens_per_s / ours.tokens_per_s:.2f}x" if ours else "-"
        growth = f"{first.tokens_per_s / run.tokens_per_s:.2f}x" if first else "-"
        host = f"{run.host_ms_per_step:.2f}" if run.host_ms_per_step is not None else "-"
        share = f"{run.host_share:.0%}" if run.host_share is not None else "-"
        print(f"| {name} | {length} | {run.elapsed_s:.1f} | {run.tokens_per_s:.0f} | {ratio} | "
              f"{growth} | {host} | {share} |")


if __name__ == "__main__":
    main()
