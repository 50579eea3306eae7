"""The GRPO workload of `benchmarks/spec_decode.py --grpo`: P prompts x G samples, the same
prompts for several epochs, sampled at temperature 1 by a policy that has learnt one
completion per prompt, 32 to 272 tokens long (`template_model.py`), with no drafting, n-gram
drafting and suffix drafting side by side. Each epoch seeds its prompts anew (the same seeds
for every system), so the three systems must give identical tokens while each epoch's samples
differ from the last.

Reported per epoch: the makespan (the wall time of the epoch's `generate`: the step is as long
as its longest rollout) and tok/s; then suffix against n-gram and against no drafting. A second
table runs a random model at batch 64, where nothing repeats: drafting must not cost much.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.template_model import build_template_model, templates
from rollout_engine import LLM, SamplingParams
from rollout_engine.tiny_model import build_tiny_model

GOAL_VS_NGRAM = 1.3
GOAL_MAKESPAN_CUT = 0.40
GOAL_NO_REPEATS = 0.95
SYSTEMS = ("none", "ngram", "suffix")


@dataclass
class Epoch:
    elapsed_s: float
    token_ids: list[list[list[int]]]
    spec: dict[str, float]

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for prompt in self.token_ids for c in prompt)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s


def make_llm(model_dir: str, system: str, args: argparse.Namespace, max_num_seqs: int) -> LLM:
    options = {}
    if system != "none":
        options["speculative_config"] = {"method": system,
                                         "num_speculative_tokens": args.num_speculative_tokens}
    return LLM(model_dir, device=args.device, kv_cache_bytes=256 * 1024**2,
               max_num_seqs=max_num_seqs, **options)


def run_epoch(llm: LLM, prompts: list[list[int]], num_samples: int, epoch: int,
              max_tokens: list[int]) -> Epoch:
    params = [SamplingParams(n=num_samples, temperature=1.0, max_tokens=cap,
                             seed=10_007 * epoch + i) for i, cap in enumerate(max_tokens)]
    before = llm.stats()
    gc.collect()  # the engines' garbage is collected here, not in another system's run
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed_s = time.perf_counter() - start
    after = llm.stats()
    spec = {k: after[k] - before.get(k, 0) for k in after if k.startswith("spec_num_")}
    return Epoch(elapsed_s, [[c.token_ids for c in o.outputs] for o in outputs], spec)


def acceptance(spec: dict[str, float]) -> str:
    drafts, steps = spec.get("spec_num_drafts", 0), spec.get("spec_num_draft_steps", 0)
    if not drafts:
        return "–"
    accepted = spec["spec_num_accepted_tokens"]
    return f"{accepted / drafts:.2f} / {1 + accepted / steps:.2f}"


def check_identical(runs: dict[str, list[Epoch]]) -> None:
    reference = runs["none"]
    for system, epochs in runs.items():
        for e, (mine, theirs) in enumerate(zip(epochs, reference)):
            if mine.token_ids != theirs.token_ids:
                sys.exit(f"FAIL: {system}, epoch {e + 1}: tokens differ from no drafting")


def grpo_table(args: argparse.Namespace) -> None:
    model_dir = str(build_template_model(Path(args.cache_dir).parent / "template_model"))
    pairs = templates()[: args.grpo_prompts]
    prompts = [prompt for prompt, _ in pairs]
    max_tokens = [len(completion) + 16 for _, completion in pairs]  # room to stray
    warm_up = [templates(seed=99)[0][0]]
    num_samples, num_epochs = args.grpo_samples, args.grpo_epochs
    batch = len(prompts) * num_samples
    llms = {system: make_llm(model_dir, system, args, batch) for system in SYSTEMS}
    for llm in llms.values():
        run_epoch(llm, warm_up, 1, -1, [8])  # a prompt of no epoch: its history helps none
    runs: dict[str, list[Epoch]] = {system: [] for system in SYSTEMS}
    for e in range(num_epochs):  # the systems in turn (rotated), each epoch: the same load
        for system in SYSTEMS[e % 3:] + SYSTEMS[: e % 3]:
            runs[system].append(run_epoch(llms[system], prompts, num_samples, e, max_tokens))
    check_identical(runs)
    k = args.num_speculative_tokens
    print(f"\nGRPO: {len(prompts)} prompts x {num_samples} samples (batch {batch}), temperature "
          f"1, {num_epochs} epochs, k = {k}, template policy ({min(max_tokens) - 16} to "
          f"{max(max_tokens) - 16}-token completions); tokens identical across systems ✓\n")
    print("| epoch | tokens | none: makespan s, tok/s | n-gram: makespan s, tok/s, accept / "
          "length | suffix: makespan s, tok/s, accept / length | suffix / n-gram | suffix "
          "makespan vs none |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for e in range(num_epochs):
        none, ngram, suffix = (runs[s][e] for s in SYSTEMS)
        vs_ngram = suffix.tokens_per_s / ngram.tokens_per_s
        cut = 1 - suffix.elapsed_s / none.elapsed_s
        print(f"| {e + 1} | {none.num_tokens} | {none.elapsed_s:.2f}, {none.tokens_per_s:.0f} | "
              f"{ngram.elapsed_s:.2f}, {ngram.tokens_per_s:.0f}, {acceptance(ngram.spec)} | "
              f"{suffix.elapsed_s:.2f}, {suffix.tokens_per_s:.0f}, {acceptance(suffix.spec)} | "
              f"{vs_ngram:.2f}x | {-cut:+.0%} |", flush=True)
    later = range(1, num_epochs)
    vs_ngram = min(runs["suffix"][e].tokens_per_s / runs["ngram"][e].tokens_per_s for e in later)
    cut = min(1 - runs["suffix"][e].elapsed_s / runs["none"][e].elapsed_s for e in later)
    print(f"\nfrom epoch 2: suffix >= {vs_ngram:.2f}x n-gram (goal {GOAL_VS_NGRAM}x: "
          f"{'met' if vs_ngram >= GOAL_VS_NGRAM else 'MISSED'}), makespan {-cut:+.0%} against no "
          f"drafting (goal -{GOAL_MAKESPAN_CUT:.0%}: "
          f"{'met' if cut >= GOAL_MAKESPAN_CUT else 'MISSED'})")


def no_repeats_table(args: argparse.Namespace) -> None:
    """A random model at batch 64: nothing repeats, drafting finds (almost) nothing."""
    model_dir = Path(args.cache_dir).parent / "random_model"
    if not (model_dir / "config.json").is_file():
        build_tiny_model(model_dir, "llama", "tiny", 0)
    prompts = [prompt for prompt, _ in templates(seed=1)] * 4  # 64 prompts
    llms = {system: make_llm(str(model_dir), system, args, 64) for system in ("none", "suffix")}
    speeds = dict.fromkeys(llms, 0.0)
    for llm in llms.values():
        run_epoch(llm, [templates(seed=99)[0][0]], 1, -1, [8])
    for e in range(args.grpo_epochs):
        for system, llm in llms.items():
            run = run_epoch(llm, prompts, 1, e, [64] * len(prompts))
            speeds[system] = max(speeds[system], run.tokens_per_s)
    ratio = speeds["suffix"] / speeds["none"]
    print(f"\nno repeats (random model, batch 64, best of {args.grpo_epochs}): none "
          f"{speeds['none']:.0f} tok/s, suffix {speeds['suffix']:.0f} tok/s: {ratio:.2f}x "
          f"(goal >= {GOAL_NO_REPEATS}x: {'met' if ratio >= GOAL_NO_REPEATS else 'MISSED'})")
