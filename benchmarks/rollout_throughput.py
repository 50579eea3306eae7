"""GRPO-shaped rollout throughput: our engine vs Hugging Face `generate` and `generate_batch`.

A batch of prompts x n samples, temperature 1, a fixed number of new tokens (EOS
ignored everywhere so every system generates the same tokens count), run side by side
in one process on the same model.

    python -m benchmarks.rollout_throughput                 # the default workload
    python -m benchmarks.rollout_throughput --num-prompts 8 --max-tokens 32   # quick look

`--threads N` fixes every system's OpenMP threads (the engine's through `cpu_threads`);
by default each uses its own policy: torch's default for Hugging Face, and for the engine
the cores other processes leave free (see `rollout_engine/worker/cpu_threads.py`).
`--contention K` starts K busy processes for the whole run, to see how each system copes
with a loaded machine.

vLLM's CPU build (`make peers`, a venv of its own) runs side by side when it is installed
(unseeded: a per-request seed crashes it on the CPU); the script says so when it is not, and
`--skip vllm` leaves it out.

`--greedy-check` then samples every prompt greedily (n=1, the same new tokens) with the engine
and with vLLM (eager) and says how many sequences are identical, and where the others part.

`--repeats R` runs every system R times, rounds in turn, and keeps each one's best run (the
machine's speed drifts by 20% over minutes). `--torch-attention` adds the engine without its
compiled CPU attention kernel.

The compute floor row is what no engine can beat on this model: the dense forward of the
tokens that must be computed (each distinct prompt once, then one [rows, 1] forward per
decode step, with attention over the context left out), timed with the same weights.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from benchmarks.common import (
    add_grpo_workload_args,
    add_model_args,
    add_vllm_modes_arg,
    left_padded,
    make_prompts,
    run_rounds,
    run_vllm,
    vllm_available,
    vllm_missing_note,
)
from rollout_engine import LLM, SamplingParams
from rollout_engine.tiny_model import build_tiny_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    add_grpo_workload_args(parser, max_tokens=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["generate", "generate_batch", "vllm"])
    parser.add_argument("--threads", type=int,
                        help="OpenMP threads of every system (default: each its own policy)")
    parser.add_argument("--contention", type=int, default=0,
                        help="busy processes running alongside (default: 0)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="also run the engine with async scheduling (a row of its own)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of every system, alternating; the best of each is kept")
    parser.add_argument("--torch-attention", action="store_true",
                        help="also run the engine without the compiled CPU attention kernel")
    parser.add_argument("--skip-floor", action="store_true", help="do not time the floor")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also run the engine with CUDA graphs (a row of its own)")
    add_vllm_modes_arg(parser, default=["eager", "compiled"])
    parser.add_argument("--greedy-check", action="store_true",
                        help="after the table: greedy tokens of the engine against vLLM's")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="weights and activations (default: float32 on CPU, bfloat16 on CUDA)")
    args = parser.parse_args()
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    return args


def run_engine(
    model_dir: str, prompts, args, cuda_graphs: bool = False, async_scheduling: bool = False,
    torch_attention: bool = False,
) -> tuple[float, int]:
    """One fresh engine (nothing cached from an earlier run) generating the whole workload."""
    with mock.patch.dict(os.environ):  # the switch as it was afterwards
        if torch_attention:  # the CPU attention without the compiled kernel
            os.environ["ROLLOUT_ENGINE_CPU_KERNEL"] = "0"
        return _run_engine(model_dir, prompts, args, cuda_graphs, async_scheduling)


def _engine(model_dir: str, args, max_num_seqs: int, **options) -> LLM:
    return LLM(model_dir, max_num_batched_tokens=args.max_num_batched_tokens,
               max_num_seqs=max_num_seqs, kv_cache_bytes=2 * 1024**3, device=args.device,
               dtype=args.dtype, cpu_threads=args.threads, **options)


def _run_engine(model_dir, prompts, args, cuda_graphs, async_scheduling) -> tuple[float, int]:
    llm = _engine(model_dir, args, len(prompts) * args.n, cuda_graphs=cuda_graphs,
                  async_scheduling=async_scheduling)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens,
                            ignore_eos=True, seed=args.seed)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    llm.engine.shutdown()
    return elapsed, sum(len(o.token_ids) for out in outputs for o in out.outputs)


@torch.inference_mode()
def run_compute_floor(model_dir: str, prompts, args) -> tuple[float, int]:
    """The dense forward of what must be computed: every distinct prompt once, then one
    [rows, 1] forward per decode step (no KV cache: attention over the context left out)."""
    model = _hf_model(model_dir, args)
    rows = len(prompts) * args.n
    decode_input = torch.full((rows, 1), 3, dtype=torch.long, device=args.device)
    model(decode_input, use_cache=False)  # warm-up
    _sync(args)
    start = time.perf_counter()
    for prompt in prompts:
        model(torch.tensor([prompt], device=args.device), use_cache=False)
    for _ in range(args.max_tokens - 1):  # the first token comes from the prompt's forward
        model(decode_input, use_cache=False)
    _sync(args)
    return time.perf_counter() - start, rows * args.max_tokens


def _sync(args) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.synchronize(args.device)


def _hf_model(model_dir: str, args, attn_implementation: str | None = None):
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, args.dtype), **kwargs
    ).to(args.device).eval()
    model.generation_config.eos_token_id = None
    return model


def _generation_config(args):
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_tokens,
        num_return_sequences=args.n, eos_token_id=None, pad_token_id=0,
    )


@torch.inference_mode()
def run_hf_generate(model_dir: str, prompts, args) -> tuple[float, int]:
    """TRL's default path: left-padded batch, every prompt repeated n times."""
    model = _hf_model(model_dir, args)
    input_ids, mask = left_padded(prompts)
    max_len = input_ids.shape[1]
    input_ids, mask = input_ids.to(args.device), mask.to(args.device)
    _sync(args)
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=mask, generation_config=_generation_config(args))
    _sync(args)
    elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - max_len) * out.shape[0]


@torch.inference_mode()
def run_hf_generate_batch(model_dir: str, prompts, args) -> tuple[float, int]:
    """TRL's continuous-batching path (transformers' paged `generate_batch`)."""
    model = _hf_model(model_dir, args, attn_implementation="sdpa")
    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=_generation_config(args),
                                   progress_bar=True)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(r.generated_tokens) for r in results.values())


def run_vllm_peer(model_dir: str, prompts, args, eager: bool) -> tuple[float, int]:
    """vLLM's CPU build on the same workload and dtype, in its own venv and process."""
    result = _vllm_job(model_dir, prompts, args, eager)
    return result["elapsed_s"][0], result["num_tokens"]


def _vllm_job(model_dir: str, prompts, args, eager: bool, greedy: bool = False) -> dict:
    return run_vllm(model_dir, prompts, n=args.n, max_tokens=args.max_tokens,
                    max_model_len=args.max_prompt_len + args.max_tokens + 16,
                    max_num_batched_tokens=args.max_num_batched_tokens, threads=args.threads,
                    dtype=args.dtype, enforce_eager=eager, greedy=greedy)


@contextlib.contextmanager
def busy_processes(count: int):
    """`count` processes spinning on the CPU while the block runs."""
    processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                 for _ in range(count)]
    try:
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp, busy_processes(args.contention):
        model_dir = args.model or str(build_tiny_model(Path(tmp) / "model", args.arch, args.size))
        from transformers import AutoConfig

        prompts = make_prompts(args, AutoConfig.from_pretrained(model_dir).vocab_size)
        print(f"workload: {len(prompts)} prompts x n={args.n}, prompt lengths "
              f"{args.min_prompt_len}-{args.max_prompt_len}, {args.max_tokens} new tokens, "
              f"T=1, threads: {args.threads or 'each its own policy'}, "
              f"{args.contention} busy processes, {args.device} {args.dtype}")
        systems = {"rollout_engine": lambda: run_engine(model_dir, prompts, args)}
        if args.torch_attention:
            systems["rollout_engine, torch attention"] = lambda: run_engine(
                model_dir, prompts, args, torch_attention=True
            )
        if args.async_scheduling:
            systems["rollout_engine, async scheduling"] = lambda: run_engine(
                model_dir, prompts, args, async_scheduling=True
            )
        if args.cuda_graphs:
            systems["rollout_engine + CUDA graphs"] = lambda: run_engine(
                model_dir, prompts, args, cuda_graphs=True
            )
        if "vllm" not in args.skip and args.device == "cpu":
            if vllm_available():
                for mode in args.vllm_modes:
                    systems[f"vLLM (CPU build, {mode})"] = functools.partial(
                        run_vllm_peer, model_dir, prompts, args, mode == "eager")
            else:
                print(vllm_missing_note())
        if "generate" not in args.skip:
            systems["HF generate (padded)"] = lambda: run_hf_generate(model_dir, prompts, args)
        if "generate_batch" not in args.skip:
            systems["HF generate_batch"] = lambda: run_hf_generate_batch(model_dir, prompts, args)
        if not args.skip_floor:
            systems["compute floor (dense forward only)"] = lambda: run_compute_floor(
                model_dir, prompts, args
            )
        results = run_rounds(systems, args.repeats, elapsed_of=lambda result: result[0])
        print_table(results)
        if args.greedy_check and vllm_available() and args.device == "cpu":
            print_greedy_agreement(model_dir, prompts, args)


def print_greedy_agreement(model_dir: str, prompts, args) -> None:
    """Greedy tokens of the engine and of vLLM (eager) on every prompt, compared."""
    llm = _engine(model_dir, args, len(prompts))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    theirs = _vllm_job(model_dir, prompts, args, eager=True, greedy=True)["token_ids"]
    parted = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
              for x, y in zip(ours, theirs) if list(x) != list(y)]
    print(f"\ngreedy ({args.dtype}, {args.max_tokens} new tokens): {len(prompts) - len(parted)} "
          f"of {len(prompts)} sequences identical to vLLM's"
          + (f"; the others part at tokens {sorted(parted)}" if parted else ""))


def print_table(results: dict[str, tuple[float, int]]) -> None:
    ours = results["rollout_engine"]
    ours_tps = ours[1] / ours[0]
    print("\n| system | time (s) | tokens | tokens/s | rollout_engine speed-up |")
    print("|---|---:|---:|---:|---:|")
    for name, (elapsed, tokens) in results.items():
        tps = tokens / elapsed
        print(f"| {name} | {elapsed:.1f} | {tokens} | {tps:.0f} | {ours_tps / tps:.2f}x |")
    floor = results.get("compute floor (dense forward only)")
    if floor is not None:
        print(f"\nrollout_engine reaches {ours_tps / (floor[1] / floor[0]):.0%} of the compute "
              "floor's tokens/s")


if __name__ == "__main__":
    main()
