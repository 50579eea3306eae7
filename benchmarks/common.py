"""What several benchmarks share: the model options, the GRPO-shaped workload's options and its
random prompts. Scripts import it as a sibling (`from workload import ...`)."""

from __future__ import annotations

import argparse
import random

import torch


def add_model_args(parser: argparse.ArgumentParser, arch: str = "qwen2") -> None:
    """--model (a Hugging Face directory) or a model built from --arch and --size."""
    parser.add_argument("--model", help="Hugging Face model dir (default: build --arch/--size)")
    parser.add_argument("--arch", default=arch, help="architecture of the built model")
    parser.add_argument("--size", default="small", help="size preset of the built model")


def add_grpo_workload_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """A GRPO batch: prompts of random lengths, n samples each, a fixed number of new tokens."""
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (GRPO group size)")
    parser.add_argument("--min-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--seed", type=int, default=0)


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    """`args.num_prompts` prompts of random token ids (never the special ids 0-2)."""
    rng = random.Random(args.seed)
    return [
        [rng.randrange(3, vocab_size)
         for _ in range(rng.randint(args.min_prompt_len, args.max_prompt_len))]
        for _ in range(args.num_prompts)
    ]


def left_padded(prompts: list[list[int]]):
    """(input_ids, attention_mask) [num_prompts, longest] of one left-padded batch (pad id 0),
    as Hugging Face `generate` takes them."""
    import torch

    max_len = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), max_len, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, max_len - len(p):] = torch.tensor(p)
        mask[i, max_len - len(p):] = 1
    return input_ids, mask


def kv_bytes_per_token(model_dir: str, dtype: torch.dtype) -> int:
    """KV cache bytes one token takes in the model, as the engine lays its cache out."""
    from transformers import AutoConfig

    from rollout_engine.worker.kv_cache_spec import KVCacheSpec

    config = AutoConfig.from_pretrained(model_dir)
    return KVCacheSpec.from_model(config, block_size=1, dtype=dtype).bytes_per_token
