"""The Hugging Face model as the oracle: greedy continuations and per-token logprobs."""

from __future__ import annotations

from functools import lru_cache

import torch
from transformers import AutoModelForCausalLM, GenerationConfig


@lru_cache(maxsize=8)
def load_hf_model(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare whole continuations, EOS included
    return model


@torch.inference_mode()
def hf_greedy(model_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' `generate`, EOS ignored."""
    model = load_hf_model(str(model_dir))
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
    )
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == max_new_tokens, f"HF stopped early: {tokens}"
    return tokens


@torch.inference_mode()
def hf_logprobs(model_dir: str, prompt: list[int], completion: list[int], temperature: float = 1.0):
    """log_softmax(logits / T) of the model at each completion token: [len(completion)]."""
    model = load_hf_model(str(model_dir))
    logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)] / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(completion)), torch.tensor(completion)]


@torch.inference_mode()
def hf_greedy_batch(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """`hf_greedy` for many prompts in one left-padded `generate` call."""
    model = load_hf_model(str(model_dir))
    max_len = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), max_len, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, prompt in enumerate(prompts):
        input_ids[i, max_len - len(prompt) :] = torch.tensor(prompt)
        attention_mask[i, max_len - len(prompt) :] = 1
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    out = model.generate(input_ids, attention_mask=attention_mask, generation_config=config)
    return out[:, max_len:].tolist()
