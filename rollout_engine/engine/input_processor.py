"""Prompts in, request specs out: tokenizing and checking a prompt and its parameters,
compiling its constraint; the model's tokenizer and EOS ids."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from rollout_engine.engine.prompt_text import check_prompt_length, check_text, max_prompt_chars
from rollout_engine.engine.request_spec import RequestSpec
from rollout_engine.protocol import (
    InvalidRequestError,
    KVTransferError,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

if TYPE_CHECKING:
    import concurrent.futures

    from rollout_engine.core.structured_output import GrammarCompiler
    from rollout_engine.engine.kv_connector import EngineKVConnector


class InputProcessor:
    """The model directory's tokenizer (if any) and what the engine needs to know of it; turns
    a prompt and its parameters into a `RequestSpec`."""

    def __init__(self, model_dir: str, hf_config, max_model_len: int | None = None) -> None:
        self.tokenizer = _load_tokenizer(model_dir)
        self.vocab_size: int = hf_config.vocab_size
        self.eos_token_ids = _eos_token_ids(model_dir, hf_config, self.tokenizer)
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, max_model_len)
        """Longer text prompts cannot fit `max_model_len` tokens: refused untokenized."""
        self._grammar_compiler: GrammarCompiler | None = None  # built at the first constraint

    def process(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        prompt_logprobs_from: int = 1,
        kv_connector: EngineKVConnector | None = None,
    ) -> RequestSpec:
        """One prompt's request, checked and complete; InvalidRequestError (KVTransferError for
        a KV transfer handle this engine cannot use) before any of it exists.
        `prompt_logprobs_from`: with `prompt_logprobs`, the first prompt position asked for
        (scoring asks for the completion's positions only: the prefix cache serves the rest)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams")
        text, token_ids = self.encode(prompt, params.truncate_prompt_tokens)
        self.check(params)
        if params.kv_transfer_params is not None:
            _check_kv_transfer(params, token_ids, kv_connector)
        return RequestSpec(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=tuple(token_ids),
            sampling_params=params,
            output_kind=output_kind,
            compiled_grammar=self._compile(params.structured_outputs),
            bad_words_token_ids=tuple(tuple(w) for w in self.bad_words_token_ids(params)),
            text_tokenizer=self.tokenizer if params.detokenize or params.stop else None,
            prompt_logprobs_start=(
                0 if params.prompt_logprobs is None
                else max(1, min(prompt_logprobs_from, len(token_ids)))
            ),
        )

    def encode(
        self, prompt: str | Sequence[int], truncate_prompt_tokens: int | None = None
    ) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt, its last `truncate_prompt_tokens` tokens if
        set; InvalidRequestError for anything unusable."""
        if isinstance(prompt, str):
            text = prompt
            token_ids = self.encode_text(prompt, fit_model=truncate_prompt_tokens is None)
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

    def encode_text(self, text: str, add_special_tokens: bool = True, fit_model: bool = True,
                    what: str = "the prompt") -> list[int]:
        """The token ids of a text; InvalidRequestError, before any tokenizer work, for text no
        tokenizer takes, or with `fit_model` too long to fit the model in any tokenization (a
        prompt to be truncated, or text only counted, may be longer)."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; send token ids")
        check_text(text, what)
        if fit_model:
            check_prompt_length(text, self.max_prompt_chars, self.max_model_len, what)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check(self, params: SamplingParams) -> None:
        """InvalidRequestError for what only the model can tell is wrong: token ids past its
        vocabulary, text features without a tokenizer, constraints no grammar library takes."""
        for name, ids in (("logit_bias", list(params.logit_bias)),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} names token ids {bad[:5]} outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        if params.structured_outputs is not None:  # llguidance takes UTF-8 text only
            for what, text in _constraint_texts(params.structured_outputs):
                check_text(text, what)
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
        for i, word in enumerate(params.bad_words):
            check_text(word, f"bad_words[{i}]")
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        return [s for s in sequences if s and all(t < self.vocab_size for t in s)]

    def grammars(self) -> GrammarCompiler:
        """The compiler of structured-output constraints, built at the first one (llguidance
        loads then)."""
        if self._grammar_compiler is None:
            from rollout_engine.core.structured_output import GrammarCompiler  # llguidance

            if self.tokenizer is None:
                raise InvalidRequestError(
                    "structured outputs need the model's tokenizer, and this model has none"
                )
            self._grammar_compiler = GrammarCompiler(
                self.tokenizer, self.vocab_size, self.eos_token_ids
            )
        return self._grammar_compiler

    @property
    def uses_grammars(self) -> bool:
        """A constraint came: requests may carry grammars."""
        return self._grammar_compiler is not None

    def shutdown(self) -> None:
        """Stop the grammar compiling thread, if any."""
        if self._grammar_compiler is not None:
            self._grammar_compiler.shutdown()

    def _compile(self, constraint: StructuredOutputsParams | None
                 ) -> concurrent.futures.Future | None:
        """The constraint's matcher, compiling off the engine thread; a bad schema or regex is
        refused here, at once."""
        return None if constraint is None else self.grammars().compile(constraint)


def _check_kv_transfer(params: SamplingParams, token_ids: list[int],
                       kv_connector: EngineKVConnector | None) -> None:
    if kv_connector is None:
        raise KVTransferError(
            "this engine takes no part in KV transfers; start it with --kv-role prefill, "
            "decode or both (LLM(..., kv_role=...))"
        )
    kv_params = params.kv_transfer_params
    if kv_params.do_remote_prefill and params.prompt_logprobs is not None:
        raise InvalidRequestError(
            "prompt_logprobs with a KV transfer handle: the prompt's KV is loaded, not "
            "computed here; ask the prefill engine for the prompt logprobs"
        )
    kv_connector.check_request(kv_params, token_ids)


def _constraint_texts(constraint: StructuredOutputsParams) -> Iterator[tuple[str, str]]:
    for name in ("json", "regex", "grammar"):
        text = getattr(constraint, name)
        if isinstance(text, str):
            yield f"structured_outputs.{name}", text
    for i, choice in enumerate(constraint.choice or []):
        yield f"structured_outputs.choice[{i}]", choice


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
