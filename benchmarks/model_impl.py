"""The transformers modeling backend against the native decoder, and a MoE rollout against HF.

1. The same checkpoint (llama and qwen3, the `small` preset) run natively and through the
   transformers backend (`model_impl="transformers"`) on one GRPO batch: tokens/s and the
   backend's ratio to native. Native runs twice, with its CPU linears on packed oneDNN
   weights (the default) and on plain `F.linear` as the backend does, so the ratio to the
   latter is what the backend itself costs (HF's modules, our attention through
   `AttentionInterface`).
2. A Qwen3-MoE checkpoint of the same width (8 experts, 2 per token) through the backend
   (its experts on our grouped kernel) against Hugging Face `generate` (one left-padded batch,
   `num_return_sequences=n`: TRL's default path), against the backend with its weights
   unpacked (the experts on transformers' `grouped_mm`), against vLLM's CPU build when `make
   peers` installed it (eager and compiled), and with `enable_return_routed_experts` (R3: what recording
   the routing costs).

EOS is ignored, so every system generates the same number of tokens.

    python -m benchmarks.model_impl --threads 2
    python -m benchmarks.model_impl --num-prompts 4 --max-tokens 32   # a quicker look
    python -m benchmarks.model_impl --threads 2 --only moe
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    add_grpo_workload_args,
    add_vllm_modes_arg,
    left_padded,
    make_prompts,
    run_vllm,
    vllm_available,
    vllm_missing_note,
)
from rollout_engine import LLM, SamplingParams
from rollout_engine.tiny_model import SIZES, build_tiny_model, make_config, write_model_dir


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grpo_workload_args(parser, max_tokens=64)
    parser.set_defaults(num_prompts=8)
    parser.add_argument("--size", default="small", help="size preset of the built models")
    parser.add_argument("--threads", type=int, help="OpenMP threads of every system")
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--only", choices=["dense", "moe"], help="run one of the two parts")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the dtype every system computes in")
    add_vllm_modes_arg(parser, default=["eager", "compiled"])
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each engine and vLLM workload (the best counts)")
    return parser.parse_args()


def moe_model_dir(root: Path, args: argparse.Namespace) -> Path:
    """A Qwen3-MoE checkpoint as wide as the dense preset, each expert a quarter of its MLP."""
    import transformers

    dense = make_config("qwen3", args.size)
    size = SIZES[args.size]
    config = transformers.Qwen3MoeConfig(
        **{k: v for k, v in dense.to_dict().items() if k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "max_position_embeddings", "head_dim", "rms_norm_eps",
            "initializer_range", "eos_token_id", "bos_token_id", "pad_token_id",
            "tie_word_embeddings",
        )},
        intermediate_size=size["intermediate_size"],
        moe_intermediate_size=size["intermediate_size"] // 4,
        num_experts=args.num_experts, num_experts_per_tok=2, dtype="float32",
    )
    return write_model_dir(root / "qwen3_moe", config, seed=0)


def time_engine(model_dir: Path, prompts, args, **options) -> tuple[float, int]:
    """(seconds, tokens) of the engine's rollout: the best of `--repeats` runs."""
    llm = LLM(str(model_dir), cpu_threads=args.threads, dtype=args.dtype, **options)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens,
                            ignore_eos=True, seed=args.seed)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up (kernels, packing)
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        runs.append(time.perf_counter() - start)
    llm.shutdown()
    return min(runs), sum(len(c.token_ids) for o in outputs for c in o.outputs)


@torch.inference_mode()
def time_hf_generate(model_dir: Path, prompts, args) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                 dtype=getattr(torch, args.dtype)).eval()
    input_ids, mask = left_padded(prompts)
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_tokens,
        num_return_sequences=args.n, eos_token_id=None, pad_token_id=0,
    )
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=mask, generation_config=config)
    elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - input_ids.shape[1]) * out.shape[0]


Row = tuple[str, str, float, int, str]


def dense_rows(root: Path, args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    for arch in ("llama", "qwen3"):
        model_dir = build_tiny_model(root / arch, arch, args.size)
        prompts = make_prompts(args, SIZES[args.size]["vocab_size"])
        runs = {
            "native (packed linears)": time_engine(model_dir, prompts, args),
            "native (F.linear)": time_engine(model_dir, prompts, args,
                                             cpu_packed_weights=False),
            "transformers backend": time_engine(model_dir, prompts, args,
                                                model_impl="transformers"),
        }
        backend_tps = runs["transformers backend"][1] / runs["transformers backend"][0]
        for system, (elapsed, tokens) in runs.items():
            ratio = backend_tps / (tokens / elapsed)
            rows.append((arch, system, elapsed, tokens, f"{ratio:.2f}x"))
            print(f"{arch}: {system}: {elapsed:.1f} s", flush=True)
    return rows


def moe_rows(root: Path, args: argparse.Namespace) -> list[Row]:
    moe_dir = moe_model_dir(root, args)
    prompts = make_prompts(args, SIZES[args.size]["vocab_size"])
    runs = {"transformers backend": time_engine(moe_dir, prompts, args)}
    print(f"qwen3_moe: transformers backend: {runs['transformers backend'][0]:.1f} s", flush=True)
    runs["returning routed experts (R3)"] = time_engine(moe_dir, prompts, args,
                                                        enable_return_routed_experts=True)
    runs["unpacked (experts on grouped_mm)"] = time_engine(moe_dir, prompts, args,
                                                           cpu_packed_weights=False)
    runs["HF generate (padded)"] = time_hf_generate(moe_dir, prompts, args)
    if vllm_available():
        for mode in args.vllm_modes:
            result = run_vllm(str(moe_dir), prompts, n=args.n, max_tokens=args.max_tokens,
                              max_model_len=args.max_prompt_len + args.max_tokens + 16,
                              max_num_batched_tokens=4096, threads=args.threads,
                              enforce_eager=mode == "eager", repeats=args.repeats,
                              dtype=args.dtype)
            runs[f"vLLM {result['version']} CPU ({mode})"] = (min(result["elapsed_s"]),
                                                              result["num_tokens"])
    else:
        print(vllm_missing_note())
    ours_tps = runs["transformers backend"][1] / runs["transformers backend"][0]
    rows: list[Row] = []
    for system, (elapsed, tokens) in runs.items():
        rows.append(("qwen3_moe", system, elapsed, tokens, f"{ours_tps / (tokens / elapsed):.2f}x"))
        print(f"qwen3_moe: {system}: {elapsed:.1f} s", flush=True)
    return rows


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.only != "moe":
            rows += dense_rows(Path(tmp), args)
        if args.only != "dense":
            rows += moe_rows(Path(tmp), args)
    print(f"\nworkload ({args.dtype}): {args.num_prompts} prompts x n={args.n}, prompt lengths "
          f"{args.min_prompt_len}-{args.max_prompt_len}, {args.max_tokens} new tokens, "
          f"{args.size}, threads: {torch.get_num_threads()}\n")
    print("| model | system | time (s) | tokens | tokens/s | backend's speed against it |")
    print("|---|---|---:|---:|---:|---:|")
    for model, system, elapsed, tokens, ratio in rows:
        print(f"| {model} | {system} | {elapsed:.1f} | {tokens} | {tokens / elapsed:.0f} | {ratio} |")


if __name__ == "__main__":
    main()
