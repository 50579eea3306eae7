"""What the generating routes share around `AsyncEngine.generate`: reading a request body
within the size limit, and running a handler until its client disconnects (vLLM's
`with_cancellation`): a client that hangs up frees its KV at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel

from rollout_engine.protocol import CancelledError, InvalidRequestError
from rollout_engine.server.http.api_models import unknown_fields
from rollout_engine.server.http.error_responses import RequestTooLargeError

if TYPE_CHECKING:
    from fastapi import Request

logger = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
_TOO_DEEP = "the request body is nested too deeply (arrays and objects within each other)"


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; cancelled (its prompts aborted) if the client disconnects first. Call
    it once the body was read: the next message the server gets is the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        raise CancelledError("the client disconnected; its prompts were aborted")
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_json(request: Request, model: type[M], max_bytes: int) -> M:
    """The body parsed into `model` (ValidationError for wrong fields; unknown ones are
    ignored, see `parse_body`)."""
    return parse_body(model, await read_json_object(request, max_bytes))


def parse_body(model: type[M], data: dict) -> M:
    """`data` validated as `model`; the fields it ignores are logged, once for the request
    (vLLM's warning)."""
    try:
        body = model.model_validate(data)
    except RecursionError:
        raise InvalidRequestError(_TOO_DEEP) from None
    ignored = unknown_fields(body)
    if ignored:
        logger.warning("The following fields were present in the request but ignored: %s",
                       set(ignored))
    return body


async def read_json_object(request: Request, max_bytes: int) -> dict:
    """The body as a JSON object; RequestTooLargeError past `max_bytes` (read no further),
    InvalidRequestError for anything that is not a JSON object, or nested too deeply to parse.
    `NaN` and `Infinity` parse, as in vLLM; the request's number fields refuse them."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise RequestTooLargeError(
            f"the request body has {declared} bytes, more than this server takes ({max_bytes} "
            "bytes, --max-message-bytes)")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise RequestTooLargeError(
                f"the request body has more bytes than this server takes ({max_bytes} bytes, "
                "--max-message-bytes)")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequestError(_TOO_DEEP) from None
    if not isinstance(data, dict):
        raise InvalidRequestError(
            f"the request body must be a JSON object, got {type(data).__name__}")
    return data
