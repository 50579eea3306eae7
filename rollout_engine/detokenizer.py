"""Text of a completion as its tokens arrive, and the stop strings found in it.

A request with `stop` strings gets a `StopChecker`: the scheduler hands it each token as it
is committed (`accept`), it decodes that token incrementally (tokenizers' `DecodeStream`, primed
with the prompt's last tokens so that the first token decodes in context, as it would after the
prompt) and looks for the stop strings in the text the new piece could complete. The work per
token is the new piece plus the longest stop string: the output is never decoded again whole.
"""

from __future__ import annotations

from collections.abc import Sequence

NUM_CONTEXT_TOKENS = 6
"""Prompt tokens the stream is primed with (vLLM's choice): enough for a token's leading space
and a split multi-byte character to come out as they would after the prompt."""


class IncrementalDetokenizer:
    """The text of a token sequence, one token at a time."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._backend = getattr(tokenizer, "_tokenizer", None)  # a fast tokenizer's own
        context = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        # A prompt (given as ids) may end inside a character: its last bytes belong to the
        # output's first piece, which completes it.
        num_complete = len(context)
        while num_complete and self._decode(context[:num_complete]).endswith("\ufffd"):
            num_complete -= 1
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=context[:num_complete],
                                        skip_special_tokens=skip_special_tokens)
            for token_id in context[num_complete:]:
                self._stream.step(self._backend, token_id)
        # Without a streaming decoder (slow tokenizers): vLLM's offsets. The text of
        # ids[prefix:read] is known; ids[prefix:] decoded again gives the new piece.
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = num_complete
        self.text = ""

    def step(self, token_id: int) -> str:
        """Add one token; the text it completes ("" while a character is still split)."""
        if self._backend is not None:
            piece = self._stream.step(self._backend, token_id) or ""
        else:
            piece = self._step_by_offsets(token_id)
        self.text += piece
        return piece

    def _step_by_offsets(self, token_id: int) -> str:
        self._ids.append(token_id)
        known = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new = self._decode(self._ids[self._prefix_offset :])
        if len(new) <= len(known) or new.endswith("\ufffd"):  # a split character: wait
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new[len(known) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


class StopChecker:
    """Finds the first of a request's stop strings in its output text (vLLM's semantics).

    Stop strings are looked for once `min_tokens` tokens were generated, in the text that
    piece could have completed; the first stop string found (in `stop`'s order) wins. The
    completion's text is then cut before it, or after it with `include_stop_str_in_output`.
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
        self._stop_end = 0

    def accept(self, token_id: int) -> str | None:
        """Add the next output token; the stop string it completed, if any."""
        self._num_tokens += 1
        piece = self.detokenizer.step(token_id)
        if not piece or self._num_tokens < self.min_tokens:
            return None
        text = self.detokenizer.text
        start = max(0, len(text) - len(piece) - self._max_stop_len + 1)
        for stop in self.stop:
            index = text.find(stop, start)
            if index >= 0:
                self.stop_string = stop
                self._stop_end = index + len(stop) if self.include_stop_str_in_output else index
                return stop
        return None

    @property
    def text(self) -> str:
        """The completion's text: cut at the stop string once one was found."""
        if self.stop_string is None:
            return self.detokenizer.text
        return self.detokenizer.text[: self._stop_end]
