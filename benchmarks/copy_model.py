"""Trains a tiny llama to copy a span of its prompt: the workload where n-gram drafting pays off.

A training sequence is `[BOS] span [SEP] span [EOS]`: the loss covers the copy and the
EOS, so greedy decoding of `[BOS] span [SEP]` repeats the span and stops. A two-layer
model learns this (a previous-token head plus an induction head) in 1,500 AdamW steps:
two to three minutes on one CPU thread of an idle machine. The checkpoint is written with the tokenizer and generation config of
`rollout_engine.tiny_model`, so the engine loads it like any other model directory.

    python -m benchmarks.copy_model --output benchmarks/results/copy_model --num-steps 1500
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from rollout_engine.tiny_model import BOS_TOKEN, EOS_TOKEN, SPECIAL_TOKENS, build_tiny_model

EOS_ID = SPECIAL_TOKENS.index(EOS_TOKEN)
BOS_ID = SPECIAL_TOKENS.index(BOS_TOKEN)
SEP_ID = len(SPECIAL_TOKENS)  # the first byte-level token; never drawn inside a span
FIRST_SPAN_ID = SEP_ID + 1
VOCAB_SIZE = 512
MODEL_SHAPE: dict[str, int] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 256,
    "vocab_size": VOCAB_SIZE,
}
# Short spans first, until the induction head forms (a few hundred steps), then long ones.
MIN_SPAN_TOKENS, MAX_WARMUP_SPAN_TOKENS, MAX_TRAIN_SPAN_TOKENS = 8, 32, 80
NUM_TRAIN_STEPS, NUM_SHORT_SPAN_STEPS = 1500, 700
# Written last: a directory with this file holds a finished checkpoint.
TRAINING_RECORD = "copy_training.json"


def make_span(rng: random.Random, num_tokens: int) -> list[int]:
    """Distinct random tokens: each token says unambiguously where the copy goes next."""
    return rng.sample(range(FIRST_SPAN_ID, VOCAB_SIZE), num_tokens)


def make_prompt(span: list[int]) -> list[int]:
    return [BOS_ID, *span, SEP_ID]


def make_batch(
    rng: random.Random, batch_size: int, max_span_tokens: int = MAX_TRAIN_SPAN_TOKENS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels (-100 outside the copy), right-padded with EOS."""
    sequences, label_rows = [], []
    for _ in range(batch_size):
        span = make_span(rng, rng.randint(MIN_SPAN_TOKENS, max_span_tokens))
        prompt = make_prompt(span)
        sequences.append(prompt + span + [EOS_ID])
        # labels[t] is the token at t + 1 (transformers shifts them itself).
        label_rows.append([-100] * len(prompt) + span + [EOS_ID])
    max_len = max(len(s) for s in sequences)
    input_ids = torch.full((batch_size, max_len), EOS_ID, dtype=torch.int64)  # [B, T]
    labels = torch.full((batch_size, max_len), -100, dtype=torch.int64)  # [B, T]
    for i, (seq, row) in enumerate(zip(sequences, label_rows)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(row)] = torch.tensor(row)
    return input_ids, labels


def train(model, num_steps: int, seed: int, batch_size: int = 16, lr: float = 3e-3) -> dict:
    """AdamW on fresh copy batches: linear warm-up, then cosine decay to a tenth of `lr`."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    num_warmup = max(1, num_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / num_warmup)
        * (0.55 + 0.45 * math.cos(math.pi * min(1.0, s / num_steps)))
    )
    model.train()
    start = time.perf_counter()
    for step in range(1, num_steps + 1):
        max_span_tokens = MAX_WARMUP_SPAN_TOKENS if step <= NUM_SHORT_SPAN_STEPS else MAX_TRAIN_SPAN_TOKENS
        input_ids, labels = make_batch(rng, batch_size, max_span_tokens)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == num_steps:
            print(f"  step {step}/{num_steps}: loss {loss.item():.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    model.eval()
    return {"num_steps": num_steps, "train_s": time.perf_counter() - start, "seed": seed}


@torch.no_grad()
def copy_accuracy(model, seed: int, max_span_tokens: int, num_prompts: int = 32) -> float:
    """Fraction of copy tokens the model predicts right with teacher forcing."""
    input_ids, labels = make_batch(random.Random(seed + 1), num_prompts, max_span_tokens)
    logits = model(input_ids=input_ids).logits[:, :-1]  # [B, T - 1, vocab]
    targets = labels[:, 1:]  # [B, T - 1]
    mask = targets != -100
    return (logits.argmax(-1)[mask] == targets[mask]).float().mean().item()


def build_copy_model(output_dir: str | Path, num_steps: int | None = None, seed: int = 0) -> Path:
    """Train and save the copy model to `output_dir`; reuse it if it is already there."""
    from transformers import AutoModelForCausalLM

    output_dir = Path(output_dir)
    if (output_dir / TRAINING_RECORD).is_file():
        return output_dir
    # The builder writes config, tokenizer and generation config; the weights get trained.
    build_tiny_model(output_dir, "llama", "tiny", seed, initializer_range=0.02, **MODEL_SHAPE)
    model = AutoModelForCausalLM.from_pretrained(output_dir, dtype=torch.float32)
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only add OpenMP stalls
    try:
        num_steps = num_steps or NUM_TRAIN_STEPS
        print(f"training the copy model for {num_steps} steps (about a minute or two)", flush=True)
        record = train(model, num_steps, seed)
        record["copy_accuracy"] = {
            n: copy_accuracy(model, seed, n) for n in (MAX_WARMUP_SPAN_TOKENS, MAX_TRAIN_SPAN_TOKENS)
        }
    finally:
        torch.set_num_threads(num_threads)
    print(f"copy accuracy (teacher forced, by longest span): {record['copy_accuracy']}", flush=True)
    model.save_pretrained(output_dir, safe_serialization=True)
    (output_dir / TRAINING_RECORD).write_text(json.dumps(record, indent=1))
    return output_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "copy_model"))
    parser.add_argument("--num-steps", type=int, default=NUM_TRAIN_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_copy_model(args.output, args.num_steps, args.seed))


if __name__ == "__main__":
    main()
