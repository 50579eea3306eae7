"""Prompts in and text out: tokenizing and checking prompts, detokenizing completions, EOS ids."""

from __future__ import annotations

import os
from collections.abc import Sequence

from rollout_engine.detokenizer import IncrementalDetokenizer, StopChecker
from rollout_engine.protocol import InvalidRequestError, SamplingParams


class Processor:
    """The model directory's tokenizer (if any) and what the engine needs to know of it."""

    def __init__(self, model_dir: str, hf_config) -> None:
        self.tokenizer = _load_tokenizer(model_dir)
        self.vocab_size: int = hf_config.vocab_size
        self.eos_token_ids = _eos_token_ids(model_dir, hf_config, self.tokenizer)

    def encode(
        self, prompt: str | Sequence[int], truncate_prompt_tokens: int | None = None
    ) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt, its last `truncate_prompt_tokens` tokens if
        set; InvalidRequestError for anything unusable."""
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
        if truncate_prompt_tokens is not None:
            token_ids = token_ids[-truncate_prompt_tokens:]
        return text, token_ids

    def check(self, params: SamplingParams) -> None:
        """InvalidRequestError for what only the model can tell is wrong: token ids past its
        vocabulary, text features without a tokenizer."""
        for name, ids in (("logit_bias", list(params.logit_bias)),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} names token ids {bad[:5]} outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        needs_tokenizer = [name for name in ("stop", "bad_words") if getattr(params, name)]
        if needs_tokenizer and self.tokenizer is None:
            raise InvalidRequestError(
                f"{', '.join(needs_tokenizer)} need the model's tokenizer, and this model has "
                "none; use stop_token_ids / logit_bias instead"
            )

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space when that gives other tokens of
        the same length (vLLM's rule: a word can appear either way in the output)."""
        sequences: list[list[int]] = []
        for word in params.bad_words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        return [s for s in sequences if s and all(t < self.vocab_size for t in s)]

    def stop_checker(self, params: SamplingParams, prompt_token_ids: list[int]) -> StopChecker | None:
        """The stop-string finder of one completion (None without stop strings)."""
        if not params.stop:
            return None
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.skip_special_tokens
        )
        return StopChecker(detokenizer, params.stop, params.include_stop_str_in_output,
                           params.min_tokens)

    def decode(self, token_ids: list[int], params: SamplingParams | None = None) -> str:
        if self.tokenizer is None:
            return ""
        params = params or SamplingParams()
        kwargs = {"skip_special_tokens": params.skip_special_tokens}
        if not params.spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False  # slow tokenizers read it
        return self.tokenizer.decode(token_ids, **kwargs)


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
