"""What batch invariance costs: its kernels, the engine and the trainer, against the defaults.

Three parts, each side by side with the default path in the same run (`--skip` any):

- linear: for each weight shape of the `small` preset (q/k/v, o, gate/up, down, LM head) and
  1 / 16 / 64 / 256 rows, one batch-invariant linear layer (its packed weight reused, as in the
  engine) against torch's (MKL / oneDNN): time,
  GFLOP/s, and how many rows change their bits when computed alone instead of in the batch.
- engine: a GRPO rollout (`--num-prompts` x `--n`, `--max-tokens` new) with
  `LLM(..., batch_invariant=True)` against the default engine, fp32 and bf16; then a long
  generation (`--long-num-prompts` x `--long-n`, `--long-tokens` new) the same way.
- trainer: forward + backward of TRL's logprob computation over a GRPO batch
  (`--trainer-rows` sequences of prompt + completion) under `set_batch_invariant_mode()`
  against plain, fp32 and bf16.

    python -m benchmarks.batch_invariant --threads 2
    python -m benchmarks.batch_invariant --skip engine      # kernels and trainer only
    python -m benchmarks.batch_invariant --device cuda --size 0.5b   # the Triton kernels
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import add_grpo_workload_args, add_model_args, make_prompts
from rollout_engine import LLM, SamplingParams
from rollout_engine.batch_invariant import linear, set_batch_invariant_mode
from rollout_engine.tiny_model import build_tiny_model

# (name, N, K) of the `small` preset (hidden 512, intermediate 1536, vocab 2048).
SHAPES = [("qkv", 1024, 512), ("o", 512, 512), ("gate_up", 3072, 512), ("down", 512, 1536),
          ("lm_head", 2048, 512)]
ROWS = (1, 16, 64, 256)
DTYPES = ("float32", "bfloat16")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds_per_call(fn, repeats: int) -> float:
    fn()
    _sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync()
    return (time.perf_counter() - start) / repeats


def rows_that_change(fn, x: torch.Tensor, weight: torch.Tensor) -> int:
    """Rows whose bits differ when computed alone instead of in the batch."""
    batch = fn(x, weight)
    return sum(not torch.equal(fn(x[i:i + 1], weight), batch[i:i + 1]) for i in range(len(x)))


def bench_linear(args: argparse.Namespace) -> None:
    print("\n## linear layer: time per call, GFLOP/s, rows whose bits change alone vs batched")
    print("| dtype | layer | rows | torch ms | invariant ms | invariant / torch | torch GFLOP/s "
          "| invariant GFLOP/s | torch rows changed | invariant rows changed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    totals: dict[str, list[float]] = {}
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        for name, n, k in SHAPES:
            weight = torch.randn(n, k).to(args.device, dtype)
            for m in ROWS:
                x = torch.randn(m, k).to(args.device, dtype)
                plain = seconds_per_call(lambda: F.linear(x, weight), args.repeats)  # noqa: B023
                # The weight packed once and reused, as the engine runs it (a trainer packs at
                # every call: a copy of the weight, small against its GEMMs of thousands of rows).
                with set_batch_invariant_mode(reuse_packed_weights=True):
                    ours = seconds_per_call(lambda: linear(x, weight), args.repeats)  # noqa: B023
                flops = 2 * m * n * k
                totals.setdefault(dtype_name, [0.0, 0.0])
                totals[dtype_name][0] += plain
                totals[dtype_name][1] += ours
                print(f"| {dtype_name} | {name} | {m} | {plain * 1e3:.3f} | {ours * 1e3:.3f} "
                      f"| {ours / plain:.2f}x | {flops / plain / 1e9:.1f} | "
                      f"{flops / ours / 1e9:.1f} | {rows_that_change(F.linear, x, weight)} | "
                      f"{rows_that_change(linear, x, weight)} |")
    for dtype_name, (plain, ours) in totals.items():
        print(f"{dtype_name}: all shapes and batch sizes together, invariant / torch "
              f"{ours / plain:.2f}x")


def engine_tokens_per_s(model_dir: str, prompts: list[list[int]], n: int, max_tokens: int,
                        dtype: str, batch_invariant: bool, args: argparse.Namespace) -> float:
    llm = LLM(model_dir, dtype=dtype, batch_invariant=batch_invariant, device=args.device,
              max_num_seqs=len(prompts) * n, kv_cache_bytes=2 * 1024**3,
              cpu_threads=args.threads)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                            seed=args.seed)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    llm.shutdown()
    return sum(len(c.token_ids) for o in outputs for c in o.outputs) / seconds


def bench_engine(args: argparse.Namespace, model_dir: str, vocab_size: int) -> None:
    prompts = make_prompts(args, vocab_size)
    long_args = argparse.Namespace(**{**vars(args), "num_prompts": args.long_num_prompts})
    workloads = [
        (f"GRPO {args.num_prompts} x {args.n}, {args.max_tokens} new", prompts, args.n,
         args.max_tokens),
        (f"long {args.long_num_prompts} x {args.long_n}, {args.long_tokens} new",
         make_prompts(long_args, vocab_size), args.long_n, args.long_tokens),
    ]
    rows = []
    for label, workload_prompts, n, max_tokens in workloads:
        for dtype in DTYPES:
            plain = engine_tokens_per_s(model_dir, workload_prompts, n, max_tokens, dtype, False,
                                        args)
            invariant = engine_tokens_per_s(model_dir, workload_prompts, n, max_tokens, dtype,
                                            True, args)
            rows.append((label, dtype, plain, invariant))
    print("\n## engine: tokens per second")
    print("| workload | dtype | default tok/s | batch-invariant tok/s | invariant / default |")
    print("|---|---|---:|---:|---:|")
    for label, dtype, plain, invariant in rows:
        print(f"| {label} | {dtype} | {plain:,.0f} | {invariant:,.0f} | "
              f"{invariant / plain:.2f}x |")


def bench_trainer(args: argparse.Namespace, model_dir: str, vocab_size: int) -> None:
    from transformers import AutoModelForCausalLM

    from trainer_bridge.invariant_logps import per_token_logps_and_entropies

    generator = torch.Generator().manual_seed(args.seed)
    length = args.max_prompt_len + args.max_tokens
    ids = torch.randint(3, vocab_size, (args.trainer_rows, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(args.trainer_rows):  # left-padded prompts of random length
        mask[row, :int(torch.randint(0, args.max_prompt_len - args.min_prompt_len + 1, (1,),
                                     generator=generator))] = 0
    ids, mask = ids.to(args.device), mask.to(args.device)

    def plain_step(model) -> None:
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -args.max_tokens - 1:-1]
        logps = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -args.max_tokens:, None])
        logps.mean().backward()

    def invariant_step(model) -> None:
        logps, _, _ = per_token_logps_and_entropies(model, ids, mask, args.max_tokens, 1.0)
        logps.mean().backward()

    print(f"\n## trainer: forward + backward of the logprobs, {args.trainer_rows} rows of "
          f"{length} tokens")
    print("| dtype | plain s | batch-invariant s | invariant / plain |")
    print("|---|---:|---:|---:|")
    for dtype in DTYPES:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                     attn_implementation="sdpa").to(args.device)
        plain = seconds_per_call(lambda: plain_step(model), args.trainer_repeats)  # noqa: B023
        invariant = seconds_per_call(lambda: invariant_step(model),  # noqa: B023
                                     args.trainer_repeats)
        print(f"| {dtype} | {plain:.3f} | {invariant:.3f} | {invariant / plain:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    add_grpo_workload_args(parser, max_tokens=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the Triton kernels)")
    parser.add_argument("--repeats", type=int, default=30, help="linear layer calls timed")
    parser.add_argument("--long-num-prompts", type=int, default=2)
    parser.add_argument("--long-n", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=4096)
    parser.add_argument("--trainer-rows", type=int, default=16)
    parser.add_argument("--trainer-repeats", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=[], choices=["linear", "engine", "trainer"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"device {args.device}; threads {args.threads}; "
          f"model {args.model or f'{args.arch}/{args.size}'}")
    if "linear" not in args.skip:
        bench_linear(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_model(Path(tmp) / "model", args.arch,
                                                       args.size, max_position_embeddings=8192))
        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
        if "engine" not in args.skip:
            bench_engine(args, model_dir, vocab_size)
        if "trainer" not in args.skip:
            bench_trainer(args, model_dir, vocab_size)


if __name__ == "__main__":
    main()
