"""Grammar bookkeeping for structured outputs: compiled grammars, one matcher per request.

llguidance does the grammar work (JSON Schema, regex, Lark grammars against the tokenizer's
full vocabulary). This module decides what to compile, caches it, compiles off the engine
thread, keeps each constrained request's matcher in step with its committed tokens, and
fills the step's token bitmask ([positions, ceil(num_token_ids / 32)] int32, bit set = allowed).

The tokenizer may know more ids than the model's vocabulary (a special token added on top of a
checkpoint's embedding): llguidance sees them all, the sampler reads only the model's columns
of the bitmask, so a grammar may allow such an id but it is never emitted.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Sequence

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


class RequestGrammar:
    """One constrained request's matcher, ready once its grammar has compiled."""

    def __init__(self, compiled: concurrent.futures.Future) -> None:
        self._compiled = compiled
        self._matcher: llguidance.LLMatcher | None = None

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
            self._matcher = self._compiled.result().deep_copy()
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one committed token; False if the grammar refuses it."""
        return self.matcher.consume_token(token_id)

    @property
    def is_complete(self) -> bool:
        """The constraint is satisfied and allows nothing more."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles constraints for one tokenizer: cached by constraint, on a thread of its own.

    `validate` runs on the caller's thread and raises InvalidRequestError with llguidance's
    message; the (possibly slow) construction of the matcher runs on the compile thread, so
    a grammar that compiles slowly delays only its own request.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import llguidance.hf  # imports transformers (and torch): only where a tokenizer is

        self.vocab_size = vocab_size
        """The model's vocabulary: the width of its logits."""
        self.num_token_ids = max(vocab_size, num_tokenizer_ids(hf_tokenizer))
        """The ids llguidance knows, and the bitmask's width in bits (rounded up to 32)."""
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=self.num_token_ids, eos_token=list(eos_token_ids) or None
        )
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

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"grammar failed to compile: {matcher.get_error()}")
        self.num_compiled += 1
        return matcher

    def bitmask(
        self, rows: Sequence[tuple[RequestGrammar | None, Sequence[int]]]
    ) -> np.ndarray:
        """[positions, ceil(num_token_ids / 32)] int32 for a step's sampled requests, each with its
        drafts (`len(drafts) + 1` positions): the tokens each constrained position allows,
        every token (-1) for the others.

        A request's position j is masked in the state after its first j drafts; the matcher
        consumes them and rolls back. A draft the grammar forbids is forbidden by the mask
        before it, so verification rejects it, and the positions after it go unmasked (their
        tokens are never kept)."""
        num_positions = sum(len(drafts) + 1 for _, drafts in rows)
        mask = llguidance.numpy.allocate_token_bitmask(num_positions, self.num_token_ids)
        position = 0
        for grammar, drafts in rows:
            if grammar is not None:
                matcher = grammar.matcher
                # Consuming a forbidden token would leave the matcher in its error state.
                num_valid = matcher.validate_tokens(list(drafts)) if drafts else 0
                for j in range(num_valid + 1):
                    llguidance.numpy.fill_next_token_bitmask(matcher, mask, position + j)
                    if j < num_valid:
                        assert matcher.consume_token(drafts[j]), matcher.get_error()
                if num_valid:
                    matcher.rollback(num_valid)
            position += len(drafts) + 1
        return mask

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

