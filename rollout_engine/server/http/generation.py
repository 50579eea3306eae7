"""One HTTP request's prompts on the engine thread, as the gRPC servicer runs them: admitted
against the shared limit, added all or none, followed through an OutputSink, and aborted the
moment the request ends early (a client gone, an error, a stream dropped).

Also reading a request body within the size limit, and running a handler until its client
disconnects (vLLM's `with_cancellation`): a client that hangs up frees its KV at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel

from rollout_engine.protocol import (
    CancelledError,
    InvalidRequestError,
    RequestOutput,
    RequestOutputKind,
)
from rollout_engine.server.engine_loop import OutputSink
from rollout_engine.server.http.api_models import unknown_fields
from rollout_engine.server.http.error_responses import RequestTooLargeError

if TYPE_CHECKING:
    from fastapi import Request

    from rollout_engine.protocol import SamplingParams
    from rollout_engine.server.http.context import ServingContext

logger = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
_TOO_DEEP = "the request body is nested too deeply (arrays and objects within each other)"


class EngineRun:
    """One request's prompts on the engine thread: `start()` admits and adds them (its errors
    are the request's status), `outputs()` follows them, `close()` aborts what still runs and
    releases the admission (idempotent: every way out of a request calls it)."""

    def __init__(self, serving: ServingContext, request_id: str, prompts: list[list[int]],
                 params: list[SamplingParams], output_kind: RequestOutputKind) -> None:
        self._serving = serving
        self._request_ids = [f"{request_id}:{i}" for i in range(len(prompts))]
        self._index = {rid: i for i, rid in enumerate(self._request_ids)}
        self._prompts, self._params = prompts, params
        self._sink = OutputSink(output_kind)
        self._pending: set[str] = set()
        self._admitted = None

    async def start(self) -> EngineRun:
        admitted = self._serving.admission.admit(self._params)  # n past --max-n: refused
        await admitted.__aenter__()  # past --max-inflight-requests: refused
        self._admitted = admitted
        self._pending = set(self._request_ids)
        try:
            await self._serving.engine_loop.add_requests(
                list(zip(self._request_ids, self._prompts, self._params)), self._sink)
        except BaseException:  # refused, or cancelled while the add ran: abort all
            await self.close()
            raise
        return self

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as the engine hands them out, until every prompt finished;
        a failed step's error is raised here."""
        while self._pending:
            output = await self._sink.get()
            if output.finished:
                self._pending.discard(output.request_id)
            yield self._index[output.request_id], output

    async def close(self) -> None:
        if self._pending:
            self._serving.engine_loop.abort(sorted(self._pending))
            self._pending.clear()
        admitted, self._admitted = self._admitted, None
        if admitted is not None:
            await admitted.__aexit__(None, None, None)


async def final_outputs(run: EngineRun, num_prompts: int) -> list[RequestOutput]:
    """Each prompt's final output, in prompt order; the run is closed however this ends."""
    outputs: list[RequestOutput | None] = [None] * num_prompts
    try:
        await run.start()
        async for i, output in run.outputs():
            outputs[i] = output
    finally:
        await run.close()
    return outputs  # type: ignore[return-value]


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
