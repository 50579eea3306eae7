"""PEFT LoRA adapters of the tiny test models, saved as PEFT saves them, and PEFT as the
oracle of what a model with an adapter generates."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM


def make_adapter(model_dir: str | Path, out_dir: str | Path, *, r: int = 8,
                 target_modules: list[str] | str = "all-linear", seed: int = 0,
                 lora_alpha: int = 16, scale: float = 0.2, **config: object) -> Path:
    """A random LoRA adapter of `model_dir` (A and B both non-zero, so that it changes the
    model's tokens), saved to `out_dir`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora_config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules,
                             init_lora_weights=False, **config)
    peft_model = get_peft_model(model, lora_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)


def load_peft(model_dir: str | Path, adapter_dir: str | Path) -> PeftModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter_dir).eval()


@torch.inference_mode()
def peft_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of a (PEFT) model's `generate`, EOS ignored."""
    input_ids = torch.tensor([prompt])
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def peft_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at each completion token."""
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(completion)), torch.tensor(completion)]
