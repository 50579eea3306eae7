"""vLLM's sampling features: step time with each against plain sampling, and `score` against a
Hugging Face forward, same engine, same run.

A GRPO batch (8 prompts x n=8 = 64 sequences by default, `small` preset, T=1, EOS ignored so
every mode generates the same number of tokens) sampled plainly, then with (a) stop strings
that do not occur (every step detokenizes and searches, nothing stops), (b) presence,
frequency and repetition penalties, (c) the top-20 logprobs of every position, (d) all of them
together; and (e) top-k 50, (f) the same returning each token's sampling mask (what the masks
cost is (f) against (e)). Modes alternate over `--repeats` rounds and each keeps its best
round; the prefix cache is reset before every run, so each one prefills its prompts.

Then `score`: the logprobs of the plain run's 64 completions given their prompts, against what
a trainer computes without the engine: a Hugging Face forward of the same sequences (padded
batches of `--hf-batch-size`), log_softmax and gather of the completion tokens.

    python -m benchmarks.sampling_features --threads 2
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import add_grpo_workload_args, add_model_args, make_prompts
from rollout_engine import LLM, SamplingParams
from rollout_engine.tiny_model import build_tiny_model

STOP_STRINGS = ["</answer>", "\n\nUser:"]
"""What RL rollouts stop on; with random prompts they never occur."""
MODES: dict[str, dict] = {
    "plain": {},
    "(a) stop strings": {"stop": STOP_STRINGS},
    "(b) presence+frequency+repetition penalties": {
        "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "(c) top-20 logprobs": {"logprobs": 20},
}
MODES["(d) all together"] = {k: v for fields in MODES.values() for k, v in fields.items()}
MODES["(e) top-k 50"] = {"top_k": 50}
MODES["(f) top-k 50 + sampling masks"] = {"top_k": 50, "return_sampling_mask": True}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    add_grpo_workload_args(parser, max_tokens=64)
    parser.set_defaults(num_prompts=8)
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds per mode")
    parser.add_argument("--hf-batch-size", type=int, default=16,
                        help="sequences per Hugging Face forward when scoring")
    parser.add_argument("--threads", type=int,
                        help="OpenMP threads of the engine and of Hugging Face (default: each "
                             "its own policy)")
    parser.add_argument("--device", default="cpu")
    return parser.parse_args()


@dataclass
class Run:
    elapsed_s: float
    num_steps: int
    num_tokens: int

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.elapsed_s / self.num_steps

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s


def run_mode(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    """One generation of the whole batch from a cold prefix cache: (Run, outputs)."""
    llm.reset_prefix_cache()
    engine = llm.engine
    step, num_steps = engine.step, 0

    def counted_step():
        nonlocal num_steps
        num_steps += 1
        return step()

    engine.step = counted_step
    try:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed_s = time.perf_counter() - start
    finally:
        engine.step = step
    completions = [c for o in outputs for c in o.outputs]
    if params.logprobs is not None:  # the cost measured must include them
        assert all(c.top_logprobs is not None and len(c.top_logprobs) == len(c.token_ids)
                   and len(c.top_logprobs[0].token_ids) == params.logprobs + 1
                   for c in completions), "the engine returned no top logprobs"
    return Run(elapsed_s, num_steps, sum(len(c.token_ids) for c in completions)), outputs


def run_modes(llm: LLM, prompts, args) -> tuple[dict[str, Run], list]:
    """Every mode once per round, rounds in turn; each mode's best round is kept."""
    best: dict[str, Run] = {}
    plain_outputs: list = []
    for round_index in range(args.repeats):
        for name, fields in MODES.items():
            params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens,
                                    ignore_eos=True, seed=args.seed, **fields)
            run, outputs = run_mode(llm, prompts, params)
            plain_outputs = outputs if name == "plain" else plain_outputs
            print(f"round {round_index + 1}/{args.repeats}: {name}: {run.elapsed_s:.2f} s, "
                  f"{run.ms_per_step:.1f} ms/step", flush=True)
            if name not in best or run.elapsed_s < best[name].elapsed_s:
                best[name] = run
    return best, plain_outputs


def run_engine_score(llm: LLM, sequences, prompt_lens, repeats: int) -> tuple[float, list]:
    best_s, scores = float("inf"), []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        scores = llm.score(sequences, prompt_lens)
        best_s = min(best_s, time.perf_counter() - start)
    return best_s, [s.logprobs for s in scores]


@torch.inference_mode()
def run_hf_score(model, sequences, prompt_lens, batch_size: int, repeats: int):
    """A trainer's recompute: padded forwards, log_softmax, gather of the completion tokens."""
    best_s, logprobs = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        logprobs = []
        for first in range(0, len(sequences), batch_size):
            chunk = sequences[first:first + batch_size]
            lens = prompt_lens[first:first + batch_size]
            longest = max(len(s) for s in chunk)
            input_ids = torch.zeros(len(chunk), longest, dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for i, s in enumerate(chunk):
                input_ids[i, :len(s)] = torch.tensor(s)
                mask[i, :len(s)] = 1
            logits = model(input_ids, attention_mask=mask).logits  # [batch, longest, vocab]
            for i, (s, n) in enumerate(zip(chunk, lens)):
                rows = logits[i, n - 1:len(s) - 1].float().log_softmax(-1)  # [completion, vocab]
                logprobs.append(rows.gather(1, torch.tensor(s[n:])[:, None])[:, 0].tolist())
        best_s = min(best_s, time.perf_counter() - start)
    return best_s, logprobs


def print_modes(results: dict[str, Run]) -> None:
    plain = results["plain"]
    print("\n| mode | time (s) | steps | tokens | tokens/s | ms/step | vs plain (ms/step) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, run in results.items():
        ratio = run.ms_per_step / plain.ms_per_step
        print(f"| {name} | {run.elapsed_s:.2f} | {run.num_steps} | {run.num_tokens} | "
              f"{run.tokens_per_s:.0f} | {run.ms_per_step:.1f} | {ratio:.3f}x ({ratio - 1:+.1%}) |")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_model(Path(tmp) / "model", args.arch, args.size))
        llm = LLM(model_dir, max_num_seqs=args.num_prompts * args.n, kv_cache_bytes=1 << 30,
                  device=args.device, cpu_threads=args.threads)
        prompts = make_prompts(args, llm.engine.info().vocab_size)
        print(f"workload: {len(prompts)} prompts x n={args.n} = {len(prompts) * args.n} "
              f"sequences, prompt lengths {args.min_prompt_len}-{args.max_prompt_len}, "
              f"{args.max_tokens} new tokens (EOS ignored), T=1, threads: "
              f"{args.threads or 'each its own policy'}, {args.repeats} alternating rounds")
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, logprobs=20, stop=STOP_STRINGS))
        results, outputs = run_modes(llm, prompts, args)
        sequences = [o.prompt_token_ids + c.token_ids for o in outputs for c in o.outputs]
        prompt_lens = [len(o.prompt_token_ids) for o in outputs for _ in o.outputs]
        num_scored = sum(len(s) - n for s, n in zip(sequences, prompt_lens))
        engine_s, engine_logprobs = run_engine_score(llm, sequences, prompt_lens, args.repeats)
        llm.engine.shutdown()
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf_s, hf_logprobs = run_hf_score(model, sequences, prompt_lens, args.hf_batch_size,
                                         args.repeats)
    print_modes(results)
    max_diff = max(abs(a - b) for e, h in zip(engine_logprobs, hf_logprobs) for a, b in zip(e, h))
    print(f"\nscore: {len(sequences)} sequences, {num_scored} completion tokens "
          f"(max |engine - HF| logprob {max_diff:.1e})\n")
    print("| system | time (s) | completion tokens/s | speed-up over HF |")
    print("|---|---:|---:|---:|")
    for name, elapsed_s in (("rollout_engine score", engine_s),
                            (f"HF forward + log_softmax (batches of {args.hf_batch_size})", hf_s)):
        print(f"| {name} | {elapsed_s:.2f} | {num_scored / elapsed_s:.0f} | "
              f"{hf_s / elapsed_s:.2f}x |")


if __name__ == "__main__":
    main()
