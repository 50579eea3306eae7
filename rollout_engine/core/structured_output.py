"""Grammar bookkeeping for structured outputs: compiled grammars, one matcher per request.

llguidance does the grammar work (JSON Schema, regex, Lark grammars against the tokenizer's
full vocabulary). This module decides what to compile, caches it, compiles off the engine
thread, keeps each constrained request's matcher in step with its committed tokens, and
fills the step's token bitmask ([positions, ceil(num_token_ids / 32)] int32, bit set = allowed).

The tokenizer may know more ids than the model's vocabulary (a special token added on top of a
checkpoint's embedding): llguidance sees them all, the sampler reads only the model's columns
of the bitmask, so a grammar may allow such an id but it is never emitted. llguidance sees the
tokenizer as it encodes text: an added token that is not special (Qwen's `<tool_call>`) is the
text it stands for, a special one only itself.

Once the grammar is complete its mask allows only EOS (vLLM's rule): the completion ends with a
sampled EOS, returned like any token. That EOS ends the constraint; with `ignore_eos` the tokens
after it are free, as in vLLM.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import llguidance.numpy
import numpy as np

from rollout_engine.protocol import InvalidRequestError, StructuredOutputsParams

# JSON without free-form whitespace between tokens: a sampled completion cannot wander off
# into whitespace (llguidance's default allows any).
_JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not validated yet)."""
    kind = params.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(params.json, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_JSON_OPTIONS
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in params.choice)  # Lark string literals
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)


def num_tokenizer_ids(hf_tokenizer) -> int:
    """1 + the largest id a Hugging Face tokenizer knows, added tokens included."""
    return max(hf_tokenizer.get_vocab().values(), default=-1) + 1


def _llguidance_tokenizer(
    hf_tokenizer, num_token_ids: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for a Hugging Face one, `num_token_ids` ids wide.

    llguidance's own loader takes every added token for a special one, whose bytes no text
    matches; but the tokenizer encodes an added token's text to it, so a constraint whose text
    holds it (Qwen's `<tool_call>`) let the token through the mask and then refused it. With
    such tokens, llguidance gets the tokenizer through a `TokenizerWrapper` instead: the same
    bytes and the same encoding (the loader's), special only for the tokenizer's special
    tokens.
    """
    import llguidance.hf  # imports transformers (and torch): only where a tokenizer is

    eos = list(eos_token_ids) or None
    loaded = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=num_token_ids, eos_token=eos)
    added = hf_tokenizer.added_tokens_decoder  # id -> AddedToken
    special_ids = {i for i, token in added.items() if token.special}
    special_ids |= set(hf_tokenizer.all_special_ids)
    if not set(added) - special_ids:
        return loaded
    # An id the tokenizer lacks (the model's vocabulary may be larger) has no bytes.
    known_ids = set(hf_tokenizer.get_vocab().values())
    tokens = [loaded.decode_bytes([i]) if i in known_ids else b"" for i in range(num_token_ids)]
    wrapper = llguidance.TokenizerWrapper(_ByteTokenizer(
        loaded, tokens, sorted(i for i in special_ids if i < num_token_ids),
        hf_tokenizer.bos_token_id,
    ))
    return llguidance.LLTokenizer(wrapper, n_vocab=num_token_ids, eos_token=eos)


class _ByteTokenizer:
    """What `llguidance.TokenizerWrapper` reads: each id's bytes, the special ids, EOS and BOS,
    and an encode function (the loaded tokenizer's: the Hugging Face tokenizer, added tokens
    split out, without the prefix space some add to a whole text)."""

    def __init__(self, loaded: llguidance.LLTokenizer, tokens: list[bytes],
                 special_token_ids: list[int], bos_token_id: int | None) -> None:
        self._loaded = loaded
        self.tokens = tokens
        self.special_token_ids = special_token_ids
        self.eos_token_id = loaded.eos_token
        self.bos_token_id = bos_token_id

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, str):
            text = text.encode("utf-8")
        return self._loaded.tokenize_bytes(text)


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled for one tokenizer: the matcher each request copies."""

    matcher: llguidance.LLMatcher
    eos_token_ids: frozenset[int]


class RequestGrammar:
    """One constrained request's matcher, ready once its grammar has compiled."""

    def __init__(self, compiled: concurrent.futures.Future) -> None:
        self._compiled = compiled
        self._matcher: llguidance.LLMatcher | None = None
        self.is_terminated = False
        """It accepted an EOS: the constraint is over and later tokens are free (vLLM's
        rule; only a request with `ignore_eos` samples any)."""

    @property
    def is_ready(self) -> bool:
        """Compiled (or failed to: see `error`)."""
        return self._compiled.done()

    def wait(self, timeout_s: float) -> None:
        """Block until compiled (or `timeout_s`)."""
        concurrent.futures.wait([self._compiled], timeout=timeout_s)

    @property
    def error(self) -> BaseException | None:
        return self._compiled.exception() if self._compiled.done() else None

    @property
    def matcher(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            self._matcher = self._compiled.result().matcher.deep_copy()
        return self._matcher

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._compiled.result().eos_token_ids

    def accept(self, token_id: int) -> bool:
        """Advance by one committed token; False if the grammar refuses it. An EOS it accepts
        (the only token a complete grammar allows) ends the constraint."""
        if self.is_terminated:
            return True
        if not self.matcher.consume_token(token_id):
            return False
        self.is_terminated = token_id in self.eos_token_ids
        return True


class GrammarCompiler:
    """Compiles constraints for one tokenizer: cached by constraint, on a thread of its own.

    `validate` runs on the caller's thread and raises InvalidRequestError with llguidance's
    message; the (possibly slow) construction of the matcher runs on the compile thread, so
    a grammar that compiles slowly delays only its own request.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        """The model's vocabulary: the width of its logits."""
        self.num_token_ids = max(vocab_size, num_tokenizer_ids(hf_tokenizer))
        """The ids llguidance knows, and the bitmask's width in bits (rounded up to 32)."""
        self.tokenizer = _llguidance_tokenizer(hf_tokenizer, self.num_token_ids, eos_token_ids)
        self.eos_token_ids = frozenset(self.tokenizer.eos_tokens)
        """The tokens a complete grammar allows."""
        self._executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="grammar-compile"
        )
        self._cache: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self.num_compiled = 0

    def validate(self, params: StructuredOutputsParams) -> str:
        """The grammar of `params`; InvalidRequestError if llguidance refuses it."""
        grammar = grammar_of(params)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise InvalidRequestError(f"invalid {params.kind} constraint: {error}")
        return grammar

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled matcher of a constraint, validated here first and compiled once per
        distinct constraint; each request wraps it in a `RequestGrammar` of its own."""
        grammar = self.validate(params)
        key = (params.kind, grammar)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is None:
                compiled = self._cache[key] = self._executor.submit(self._compile, grammar)
        return compiled

    def _compile(self, grammar: str) -> CompiledGrammar:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"grammar failed to compile: {matcher.get_error()}")
        self.num_compiled += 1
        return CompiledGrammar(matcher, self.eos_token_ids)

    def bitmask(
        self, rows: Sequence[tuple[RequestGrammar | None, Sequence[int]]]
    ) -> np.ndarray:
        """[positions, ceil(num_token_ids / 32)] int32 for a step's sampled requests, each with its
        drafts (`len(drafts) + 1` positions): the tokens each constrained position allows,
        every token (-1) for the others.

        A request's position j is masked in the state after its first j drafts; the matcher
        consumes them and rolls back. A draft the grammar forbids is forbidden by the mask
        before it, so verification rejects it, and the positions after it go unmasked (their
        tokens are never kept). So do the positions after a draft EOS: it ends the
        constraint. A request whose constraint ended is unconstrained."""
        num_positions = sum(len(drafts) + 1 for _, drafts in rows)
        mask = llguidance.numpy.allocate_token_bitmask(num_positions, self.num_token_ids)
        position = 0
        for grammar, drafts in rows:
            if grammar is not None and not grammar.is_terminated:
                self._fill_positions(grammar.matcher, list(drafts), mask, position)
            position += len(drafts) + 1
        return mask

    def _fill_positions(
        self, matcher: llguidance.LLMatcher, drafts: list[int], mask: np.ndarray, position: int
    ) -> None:
        """Mask one request's positions, from `position` on, through its drafts up to the
        first it forbids or the first EOS."""
        num_before_eos = next(
            (j for j, draft in enumerate(drafts) if draft in self.eos_token_ids), len(drafts)
        )
        # Consuming a forbidden token would leave the matcher in its error state; a complete
        # matcher validates nothing (it allows only EOS, at the position after it).
        num_valid = matcher.validate_tokens(drafts[:num_before_eos]) if num_before_eos else 0
        for j in range(num_valid + 1):
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, position + j)
            if j < num_valid:
                assert matcher.consume_token(drafts[j]), matcher.get_error()
        if num_valid:
            matcher.rollback(num_valid)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

