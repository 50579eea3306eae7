"""Server-sent events as OpenAI streams them (`data: {json}` ... `data: [DONE]`), and the text
of a streamed sample piece by piece.

A stream listens for its client's disconnect the whole time, not only when it next writes: a
client that hangs up while the engine is busy gets its prompts aborted at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.responses import StreamingResponse

from rollout_engine.detokenizer import IncrementalDetokenizer
from rollout_engine.server.http.errors import stream_error_event

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from rollout_engine.protocol import CompletionOutput, SamplingParams

DONE = "data: [DONE]\n\n"


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def with_done(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events`, then `[DONE]`; an error after the stream started becomes an error event (the
    status line is gone by then), as vLLM sends it."""
    try:
        async for item in events:
            yield item
    except Exception as exc:  # noqa: BLE001 - reported in the stream
        yield stream_error_event(exc)
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    yield DONE


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` that ends (and closes its generator, whose `finally` aborts the
    prompts) as soon as the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str],
                 on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(with_done(events), media_type=self.media_type,
                         headers={"cache-control": "no-cache"})
        self._on_close = on_close
        """Always awaited at the end, even if the stream never started (its generator's
        `finally` would then never run)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream_or_drop(send))
        listen = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, listen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, listen):
                task.cancel()
            await asyncio.gather(stream, listen, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            if self._on_close is not None:
                await self._on_close()

    async def _stream_or_drop(self, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:  # the connection broke while writing: same as a disconnect
            pass


class SampleText:
    """The text one streamed sample has sent. Pieces come from an incremental detokenizer
    primed with the prompt; with stop strings, the last characters a stop string could still
    cut are held back; the sample's final text (cut by the engine) settles the rest."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._detokenizer = None
        if tokenizer is not None and params.detokenize:
            self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                       params.skip_special_tokens)
        self._num_held_chars = max((len(s) for s in params.stop), default=1) - 1
        self.sent = ""
        self.num_tokens = 0

    def delta(self, completion: CompletionOutput) -> str:
        """The new text of this output of the sample."""
        self.num_tokens += len(completion.token_ids)
        if self._detokenizer is None:
            return ""
        for token_id in completion.token_ids:
            self._detokenizer.step(token_id)
        if completion.finished:
            text = completion.text if completion.text.startswith(self.sent) else (
                self._detokenizer.text)
        else:
            text = self._detokenizer.text
            text = text[: max(len(self.sent), len(text) - self._num_held_chars)]
        piece = text[len(self.sent):]
        self.sent += piece
        return piece
