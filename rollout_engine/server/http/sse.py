"""Server-sent events as OpenAI streams them (`data: {json}` ... `data: [DONE]`). A streamed
sample's text comes from the engine piece by piece (DELTA outputs), decoded as every other
path's is.

A stream listens for its client's disconnect the whole time, not only when it next writes: a
client that hangs up while the engine is busy gets its prompts aborted at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from starlette.responses import StreamingResponse

from rollout_engine.server.http.error_responses import stream_error_event

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

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
                 on_close: Callable[[], None] | None = None) -> None:
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
                self._on_close()

    async def _stream_or_drop(self, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:  # the connection broke while writing: same as a disconnect
            pass
