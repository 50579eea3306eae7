"""Prompts in and text out: tokenizing and checking prompts, detokenizing completions, EOS ids."""

from __future__ import annotations

import os
from collections.abc import Sequence

from rollout_engine.protocol import InvalidRequestError


class Processor:
    """The model directory's tokenizer (if any) and what the engine needs to know of it."""

    def __init__(self, model_dir: str, hf_config) -> None:
        self.tokenizer = _load_tokenizer(model_dir)
        self.vocab_size: int = hf_config.vocab_size
        self.eos_token_ids = _eos_token_ids(model_dir, hf_config, self.tokenizer)

    def encode(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt; InvalidRequestError for anything unusable."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; send token ids")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise InvalidRequestError("a prompt must be a string or a list of token ids")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        return text, token_ids

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json")
    if not any(os.path.exists(os.path.join(model_dir, name)) for name in names):
        return None
    return AutoTokenizer.from_pretrained(model_dir)


def _eos_token_ids(model_dir: str, hf_config, tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else the config, else the tokenizer."""
    from transformers import GenerationConfig

    candidates = None
    if os.path.exists(os.path.join(model_dir, "generation_config.json")):
        candidates = GenerationConfig.from_pretrained(model_dir).eos_token_id
    if candidates is None:
        candidates = getattr(hf_config, "eos_token_id", None)
    if candidates is None and tokenizer is not None:
        candidates = tokenizer.eos_token_id
    if candidates is None:
        return ()
    return tuple(candidates) if isinstance(candidates, (list, tuple)) else (int(candidates),)
