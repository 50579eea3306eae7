"""Trains a tiny llama into a "policy" for the GRPO drafting benchmark: for each of a fixed set of
prompts it has learnt one completion (a reasoning template), from which sampling at
temperature 1 strays now and then and comes back. Templates run from 32 to 272 tokens, so an
epoch has a long tail: the samples of the hardest prompts, still running once the rest are
done, set its makespan.

RL trains on the same prompts epoch after epoch and its policies grow confident, so the samples
of a prompt share most of their text, and that text is not in the prompt: n-gram drafting,
which looks only at the request's own tokens, finds little; drafting from earlier completions
of the prompt finds most of it. A training sequence is `[BOS] prompt [SEP] completion [EOS]`
where a tenth of the completion's input tokens are replaced by random ones (the loss still asks
for the template's next token), so the model learns to come back after a stray token. Each
prompt's completion is drawn from a seeded generator: the model memorises them (400 AdamW
steps, two to three minutes on a CPU). Written like `copy_model.py`'s checkpoints.

    python -m benchmarks.template_model --output benchmarks/results/template_model
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from benchmarks.copy_model import BOS_ID, EOS_ID, FIRST_SPAN_ID, SEP_ID, VOCAB_SIZE
from rollout_engine.tiny_model import build_tiny_model

NUM_PROMPTS = 16
PROMPT_TOKENS = 8
MIN_COMPLETION_TOKENS, COMPLETION_STEP_TOKENS = 32, 16
"""Prompt i's template has 32 + 16 i tokens."""
NOISE = 0.1
"""Share of a completion's input tokens replaced by random ones in training."""
NUM_TRAIN_STEPS = 400
MODEL_SHAPE: dict[str, int] = {
    # Larger than the copy model: a rollout step of this one costs more in its forward than
    # in the engine's host work, as a real policy's does (where drafting pays).
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 768,
    "vocab_size": VOCAB_SIZE,
}
TRAINING_RECORD = "template_training.json"


def templates(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) pairs: the prompts the policy is trained (and benchmarked) on."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(NUM_PROMPTS):
        prompt = [BOS_ID, *rng.sample(range(FIRST_SPAN_ID, VOCAB_SIZE), PROMPT_TOKENS), SEP_ID]
        length = MIN_COMPLETION_TOKENS + COMPLETION_STEP_TOKENS * len(pairs)
        completion = [rng.randrange(FIRST_SPAN_ID, VOCAB_SIZE) for _ in range(length)]
        pairs.append((prompt, completion))
    return pairs


def make_batch(rng: random.Random, pairs, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, labels = [], []
    for prompt, completion in rng.choices(pairs, k=batch_size):
        target = completion + [EOS_ID]
        noisy = [rng.randrange(FIRST_SPAN_ID, VOCAB_SIZE) if rng.random() < NOISE else t
                 for t in completion]
        rows.append(prompt + noisy + [EOS_ID])
        # labels[t] is the token at t + 1 (transformers shifts them itself): the template's.
        labels.append([-100] * len(prompt) + target)
    width = max(len(row) for row in rows)  # right-padded with EOS, no loss there
    input_ids = torch.tensor([row + [EOS_ID] * (width - len(row)) for row in rows])
    return input_ids, torch.tensor([row + [-100] * (width - len(row)) for row in labels])


def build_template_model(output_dir: str | Path, num_steps: int = NUM_TRAIN_STEPS,
                         seed: int = 0) -> Path:
    """Train and save the policy to `output_dir`; reuse it if it is already there."""
    from transformers import AutoModelForCausalLM

    output_dir = Path(output_dir)
    if (output_dir / TRAINING_RECORD).is_file():
        return output_dir
    build_tiny_model(output_dir, "llama", "tiny", seed, initializer_range=0.02, **MODEL_SHAPE)
    model = AutoModelForCausalLM.from_pretrained(output_dir, dtype=torch.float32)
    pairs, rng = templates(seed), random.Random(seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only add OpenMP stalls
    start = time.perf_counter()
    try:
        model.train()
        for step in range(1, num_steps + 1):
            input_ids, labels = make_batch(rng, pairs, 16)
            loss = model(input_ids=input_ids, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 100 == 0 or step == num_steps:
                print(f"  step {step}/{num_steps}: loss {loss.item():.3f} "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
    finally:
        torch.set_num_threads(num_threads)
    model.eval()
    model.save_pretrained(output_dir, safe_serialization=True)
    record = {"num_steps": num_steps, "seed": seed, "final_loss": loss.item(),
              "train_s": time.perf_counter() - start}
    (output_dir / TRAINING_RECORD).write_text(json.dumps(record, indent=1))
    return output_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output",
                        default=str(Path(__file__).parent / "results" / "template_model"))
    parser.add_argument("--num-steps", type=int, default=NUM_TRAIN_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_template_model(args.output, args.num_steps, args.seed))


if __name__ == "__main__":
    main()
