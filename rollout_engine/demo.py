"""`make demo`: build a small random-weight model, generate a GRPO-style group of rollouts."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rollout_engine import LLM, SamplingParams
from rollout_engine.tiny_model import build_tiny_model

PROMPTS = [
    "the old man walked to the river and",
    "once upon a time there was a small",
    "the children began to learn about the",
    "a new idea can change the world when",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="qwen2", choices=["llama", "qwen2", "qwen3"])
    parser.add_argument("--size", default="small")
    parser.add_argument("-n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", args.arch, args.size, seed=0)
        print(f"built a random-weight {args.arch} ({args.size}) model in {model_dir}")
        llm = LLM(str(model_dir), kv_cache_bytes=256 * 1024**2)
        params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
        start = time.perf_counter()
        outputs = llm.generate(PROMPTS, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    for output in outputs:
        print(f"\nprompt: {output.prompt!r}")
        for c in output.outputs:
            mean_logprob = sum(c.logprobs) / max(len(c.logprobs), 1)
            print(f"  [{c.index}] ({c.finish_reason}, mean logprob {mean_logprob:.2f}) {c.text!r}")
    print(f"\n{num_tokens} tokens in {elapsed:.2f}s ({num_tokens / elapsed:.0f} tokens/s); "
          "the weights are random, so the text is too.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
