"""The text of a completion, made here and only here for every output path (vLLM's detokenizer).

A completion's tokens are decoded after its prompt: the decoder is primed with the prompt's last
tokens, so the first token's leading space (SentencePiece's `▁`) and a character split across
the prompt's end come out as they do after the prompt. The token that ended a completion as a
stop token (EOS, a `stop_token_ids` entry) adds no text unless `include_stop_str_in_output`.
`skip_special_tokens` and `spaces_between_special_tokens` mean what they mean to vLLM.

Text that is needed as tokens arrive (streams, stop strings) is decoded incrementally
(tokenizers' `DecodeStream`, as vLLM's `FastIncrementalDetokenizer`): a few tokens' decode per
token. Text that is needed only once a completion finished (`LLM.generate`, GenerateBatch,
non-streamed HTTP answers) is decoded then, in one call over the prompt's context and the
output (`decode_after_prompt`): the same text for a seventh of the host time (0.2 against 1.5 us
a token). Where one call could give other text (a character broken inside the output or in the
context), it is decoded incrementally then.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout_engine.protocol import SamplingParams

logger = logging.getLogger(__name__)

MIN_CONTEXT_TOKENS, MAX_CONTEXT_TOKENS = 4, 23
"""The fast decoder is primed with the prompt's shortest suffix of 4 to 23 tokens that decodes
without a broken character (vLLM's choice); a prompt of at most 4 tokens is taken whole."""
NUM_SLOW_CONTEXT_TOKENS = 6
"""Prompt tokens the decoder of a tokenizer without a `tokenizers` backend is primed with."""
REPLACEMENT_CHAR = "\ufffd"
"""What a decoder gives for bytes that do not (yet) make a character."""
MAX_HELD_TOKENS = 4
"""A character cut by the end of the output is at most this many tokens (UTF-8's 4 bytes)."""
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """The text of a token sequence after a prompt, one token at a time."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self._backend = getattr(tokenizer, "_tokenizer", None)  # a fast tokenizer's own
        self._pieces: list[str] = []
        self.num_chars = 0
        self.num_tokens = 0
        """Tokens stepped (the prompt's are not counted)."""
        if self._backend is not None:
            self._init_stream(prompt_token_ids)
            self._next_piece = self._step_stream
        else:
            self._init_offsets(prompt_token_ids)
            self._next_piece = self._step_by_offsets

    def _init_stream(self, prompt_token_ids: Sequence[int]) -> None:
        self._stream = _primed_stream(self._backend, prompt_token_ids, self._skip_special_tokens)
        # vLLM's spaces_between_special_tokens=False: two added tokens in a row are joined as
        # they are, without the space a decoder may put between them.
        self._added_tokens: dict[int, str] = {}
        if not (self._skip_special_tokens or self._spaces_between_special_tokens):
            self._added_tokens = {token_id: token.content for token_id, token in
                                  self._backend.get_added_tokens_decoder().items()}
        self._last_was_added = False

    def _init_offsets(self, prompt_token_ids: Sequence[int]) -> None:
        """Without a streaming decoder (slow tokenizers): vLLM's offsets. The text of
        ids[prefix:read] is known; ids[prefix:] decoded again gives the new piece."""
        context = list(prompt_token_ids[-NUM_SLOW_CONTEXT_TOKENS:])
        # A prompt (given as ids) may end inside a character: its last bytes belong to the
        # output's first piece, which completes it.
        num_complete = len(context)
        while num_complete and self._decode(context[:num_complete]).endswith(REPLACEMENT_CHAR):
            num_complete -= 1
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = num_complete

    # ------------------------------------------------------------------------------ reading
    @property
    def text(self) -> str:
        """Everything decoded so far (joined once, then kept joined)."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def tail(self, num_chars: int) -> str:
        """The text's last `num_chars` characters, at the cost of those characters."""
        parts: list[str] = []
        size = 0
        for piece in reversed(self._pieces):
            if size >= num_chars:
                break
            parts.append(piece)
            size += len(piece)
        text = "".join(reversed(parts))
        return text[max(0, len(text) - num_chars):] if num_chars > 0 else ""

    # ------------------------------------------------------------------------------ stepping
    def step(self, token_id: int) -> str:
        """Add one token; the text it completes ("" while a character is still split)."""
        self.num_tokens += 1
        piece = self._next_piece(token_id)
        if piece:
            self._pieces.append(piece)
            self.num_chars += len(piece)
        return piece

    def _step_stream(self, token_id: int) -> str:
        try:
            piece = self._stream.step(self._backend, token_id)
        except (OverflowError, TypeError):  # vLLM's guard: a token id the tokenizer lacks
            logger.exception("cannot decode token id %r", token_id)
            piece = None
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            # Broken bytes can make a decode change text it gave before: start again from
            # this token, as vLLM does.
            self._stream = _decode_stream(self._skip_special_tokens)
            piece = self._stream.step(self._backend, token_id)
        if self._added_tokens:
            content = self._added_tokens.get(token_id)
            if content is not None and self._last_was_added:
                piece = content
            self._last_was_added = content is not None
        return piece or ""

    def _step_by_offsets(self, token_id: int) -> str:
        self._ids.append(token_id)
        known = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new = self._decode(self._ids[self._prefix_offset :])
        if len(new) <= len(known) or new.endswith(REPLACEMENT_CHAR):  # a split character: wait
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new[len(known) :]

    def _decode(self, token_ids: list[int]) -> str:
        kwargs = {"skip_special_tokens": self._skip_special_tokens}
        if not self._spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False  # slow tokenizers read it
        return self._tokenizer.decode(token_ids, **kwargs)


def _decode_stream(skip_special_tokens: bool):
    from tokenizers.decoders import DecodeStream

    return DecodeStream(skip_special_tokens=skip_special_tokens)


def _prompt_context(backend, prompt_token_ids: Sequence[int]) -> list[int]:
    """The prompt tokens a fast decoder is primed with: the shortest suffix of 4 to 23 tokens
    whose decode has no broken character (vLLM's rule; a prompt broken throughout them, as
    vLLM would prime with all of it, is primed with its last 23 alone: its text is the same)."""
    num_tokens = len(prompt_token_ids)
    if num_tokens <= MIN_CONTEXT_TOKENS:
        return list(prompt_token_ids)
    for n in range(MIN_CONTEXT_TOKENS, min(num_tokens, MAX_CONTEXT_TOKENS) + 1):
        suffix = list(prompt_token_ids[-n:])
        if REPLACEMENT_CHAR not in backend.decode(suffix):
            return suffix
    return list(prompt_token_ids[-MAX_CONTEXT_TOKENS:])


def _primed_stream(backend, prompt_token_ids: Sequence[int], skip_special_tokens: bool):
    """A DecodeStream that has read the prompt's context token by token (as vLLM primes it:
    a character the prompt leaves split then comes out whole with the token that ends it)."""
    stream = _decode_stream(skip_special_tokens)
    for token_id in _prompt_context(backend, prompt_token_ids):
        try:
            stream.step(backend, token_id)
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            stream = _decode_stream(skip_special_tokens)
            stream.step(backend, token_id)
    return stream


def decode_after_prompt(tokenizer, prompt_token_ids: Sequence[int], token_ids: Sequence[int],
                        skip_special_tokens: bool = True,
                        spaces_between_special_tokens: bool = True) -> str | None:
    """The text `IncrementalDetokenizer` gives these tokens after this prompt, in one decode of
    the prompt's context and the tokens, minus the context's text; the last tokens of a
    character they leave unfinished give none (a stream holds them back). None where one
    decode could tell otherwise (no fast tokenizer, special tokens joined without spaces, or a
    broken character in the context or inside the text: bytes a stream decodes apart); the
    caller then decodes incrementally."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not (skip_special_tokens or spaces_between_special_tokens):
        return None
    context = _prompt_context(backend, prompt_token_ids)
    context_text = backend.decode(context, skip_special_tokens=skip_special_tokens)
    if REPLACEMENT_CHAR in context_text:
        return None
    token_ids = list(token_ids)
    whole = backend.decode(context + token_ids, skip_special_tokens=skip_special_tokens)
    for num_held in range(1, min(MAX_HELD_TOKENS, len(token_ids)) + 1):
        if not whole.endswith(REPLACEMENT_CHAR):
            break
        whole = backend.decode(context + token_ids[:-num_held],
                               skip_special_tokens=skip_special_tokens)
    if not whole.startswith(context_text) or REPLACEMENT_CHAR in whole[len(context_text):]:
        return None
    return whole[len(context_text):]


class StopChecker:
    """Finds the first of a request's stop strings in its output text (vLLM's semantics).

    Stop strings are looked for in the text each token's piece could have completed; of those
    found, the one that ends first wins, then the first in `stop`'s order. The completion's
    text is then cut before it, or after it with `include_stop_str_in_output`. A stop token
    that ended the request is never searched (`accept_stop_token`).

    `min_tokens`: stop strings are looked for once that many tokens were generated, so one may
    end in the text of token `min_tokens` itself (vLLM's V0 rule; V1 looks only from token
    `min_tokens + 1` on). Kept as it is: the first `min_tokens` tokens are generated either way.
    """

    def __init__(
        self, detokenizer: IncrementalDetokenizer, stop: Sequence[str],
        include_stop_str_in_output: bool, min_tokens: int,
    ) -> None:
        self.detokenizer = detokenizer
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self._max_stop_len = max(len(s) for s in self.stop)
        self._num_tokens = 0
        self.stop_string: str | None = None
        """The stop string that ended the completion, once one did."""
        self.num_chars: int | None = None
        """The length of the completion's text once a stop string cut it."""

    def accept(self, token_id: int) -> str | None:
        """Add the next output token; the stop string it completed, if any."""
        self._num_tokens += 1
        piece = self.detokenizer.step(token_id)
        if not piece or self._num_tokens < self.min_tokens:
            return None
        window = self.detokenizer.tail(len(piece) + self._max_stop_len - 1)
        found = [(index + len(stop), index, stop) for stop in self.stop
                 if (index := window.find(stop)) >= 0]
        if not found:
            return None
        end, index, stop = min(found, key=lambda match: match[0])  # ties: `stop`'s order
        self.stop_string = stop
        window_start = self.detokenizer.num_chars - len(window)
        self.num_chars = window_start + (end if self.include_stop_str_in_output else index)
        return stop

    def accept_stop_token(self, token_id: int) -> None:
        """The stop token that ended the request (vLLM's `stop_terminated`): its text joins
        the completion's only with `include_stop_str_in_output`, unsearched."""
        if self.include_stop_str_in_output:
            self.detokenizer.step(token_id)

    @property
    def text(self) -> str:
        """The completion's text: cut at the stop string once one was found."""
        if self.num_chars is None:
            return self.detokenizer.text
        return self.detokenizer.text[: self.num_chars]


class CompletionText:
    """The text of one completion, whatever its output kind: `final` once it finished, or
    `delta` for each output of a stream. With stop strings, the scheduler feeds every token to
    `stop_checker` as it commits it; otherwise tokens are decoded here, when asked for."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams
                 ) -> None:
        self._tokenizer = tokenizer
        self._prompt_token_ids = prompt_token_ids
        self._skip_special_tokens = params.skip_special_tokens
        self._spaces_between_special_tokens = params.spaces_between_special_tokens
        self._include_stop_token = params.include_stop_str_in_output
        self._detokenizer: IncrementalDetokenizer | None = None
        self.stop_checker: StopChecker | None = None
        self._num_held_chars = 0
        """Streams: the last characters a stop string could still cut are sent only once the
        completion finished (vLLM's `stop_buffer_length`)."""
        if params.stop:
            self._detokenizer = self._new_detokenizer()
            self.stop_checker = StopChecker(self._detokenizer, params.stop,
                                            params.include_stop_str_in_output, params.min_tokens)
            if not params.include_stop_str_in_output:
                self._num_held_chars = max(len(s) for s in params.stop) - 1
        self._num_sent_chars = 0
        self._final_text: str | None = None

    def final(self, token_ids: Sequence[int], ended_by_stop_token: bool) -> str:
        """The finished completion's text: decoded in one call if nothing was decoded yet."""
        if self._final_text is None:
            text = None
            if self._detokenizer is None:
                text = decode_after_prompt(
                    self._tokenizer, self._prompt_token_ids,
                    token_ids[: self._num_text_tokens(token_ids, ended_by_stop_token)],
                    self._skip_special_tokens, self._spaces_between_special_tokens)
            if text is None:
                self._decode(token_ids, ended_by_stop_token)
                text = self._text()
            self._final_text = text
        return self._final_text

    def delta(self, token_ids: Sequence[int], is_finished: bool, ended_by_stop_token: bool
              ) -> str:
        """The text new since the previous delta of this completion; all of it once finished.
        Costs the tokens new since then."""
        checker = self.stop_checker
        if checker is None:
            return self._decode(token_ids, ended_by_stop_token)
        detokenizer = checker.detokenizer  # the scheduler fed it every token
        num_chars = detokenizer.num_chars if checker.num_chars is None else checker.num_chars
        end = num_chars if is_finished else num_chars - self._num_held_chars
        end = max(end, self._num_sent_chars)
        unsent = detokenizer.tail(detokenizer.num_chars - self._num_sent_chars)
        piece = unsent[: end - self._num_sent_chars]
        self._num_sent_chars = end
        return piece

    def _decode(self, token_ids: Sequence[int], ended_by_stop_token: bool) -> str:
        """Step the tokens not decoded yet (not with stop strings: the scheduler does); the
        text they complete."""
        detokenizer = self._detokenizer
        if detokenizer is None:
            detokenizer = self._detokenizer = self._new_detokenizer()
        if self.stop_checker is not None:
            return ""
        start, end = detokenizer.num_tokens, self._num_text_tokens(token_ids, ended_by_stop_token)
        if end - start == 1:  # a decode step's one token
            return detokenizer.step(token_ids[start])
        return "".join([detokenizer.step(token_id) for token_id in token_ids[start:end]])

    def _num_text_tokens(self, token_ids: Sequence[int], ended_by_stop_token: bool) -> int:
        """The output tokens whose text the completion's is: all but a stop token that ended
        it, unless `include_stop_str_in_output`."""
        return len(token_ids) - int(ended_by_stop_token and not self._include_stop_token)

    def _text(self) -> str:
        if self.stop_checker is not None:
            return self.stop_checker.text
        assert self._detokenizer is not None
        return self._detokenizer.text

    def _new_detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tokenizer, self._prompt_token_ids,
                                      self._skip_special_tokens,
                                      self._spaces_between_special_tokens)
