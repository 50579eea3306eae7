"""The one place where exceptions become HTTP answers: OpenAI-style error JSON
(`{"error": {"message", "type", "param", "code"}}`, as `vllm serve` sends it) with the status the
engine's typed error names, the same errors gRPC maps in `server/status.py`.

A bad request is answered and forgotten: nothing here stops the engine.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import TYPE_CHECKING

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from rollout_engine.protocol import (
    ERROR_TYPE_KEY,
    AdmissionError,
    DeviceOutOfMemoryError,
    EngineBusyError,
    EngineError,
    EngineSleepingError,
    InvalidRequestError,
    OutOfBlocksError,
)

if TYPE_CHECKING:
    from fastapi import FastAPI, Request

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- errors of the HTTP front-end


class UnknownModelError(InvalidRequestError):
    """The request names a model this server does not serve (HTTP 404, as vLLM answers)."""


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than the server takes (HTTP 413)."""


class NotServedHereError(EngineError):
    """An endpoint of `vllm serve` this server answers only to say what to use instead
    (HTTP 501): weight transfers, which go over gRPC."""

    status_code = "UNIMPLEMENTED"


class UnauthorizedError(EngineError):
    """The request lacked the server's API key, or carried a wrong one (HTTP 401)."""

    status_code = "UNAUTHENTICATED"


# -------------------------------------------------------------------------------- the mapping

_STATUS_BY_CLASS: tuple[tuple[type[BaseException], HTTPStatus], ...] = (
    # Most specific first: the first match wins.
    (UnknownModelError, HTTPStatus.NOT_FOUND),
    (RequestTooLargeError, HTTPStatus.REQUEST_ENTITY_TOO_LARGE),
    (EngineSleepingError, HTTPStatus.SERVICE_UNAVAILABLE),
    (EngineBusyError, HTTPStatus.CONFLICT),
    (AdmissionError, HTTPStatus.TOO_MANY_REQUESTS),
    (OutOfBlocksError, HTTPStatus.BAD_REQUEST),  # too large even alone: retrying cannot help
    (DeviceOutOfMemoryError, HTTPStatus.SERVICE_UNAVAILABLE),
)
_STATUS_BY_GRPC_CODE: dict[str, HTTPStatus] = {
    "INVALID_ARGUMENT": HTTPStatus.BAD_REQUEST,
    "FAILED_PRECONDITION": HTTPStatus.CONFLICT,
    "RESOURCE_EXHAUSTED": HTTPStatus.TOO_MANY_REQUESTS,
    "UNAVAILABLE": HTTPStatus.SERVICE_UNAVAILABLE,
    "UNAUTHENTICATED": HTTPStatus.UNAUTHORIZED,
    "DEADLINE_EXCEEDED": HTTPStatus.GATEWAY_TIMEOUT,
    "UNIMPLEMENTED": HTTPStatus.NOT_IMPLEMENTED,
    "INTERNAL": HTTPStatus.INTERNAL_SERVER_ERROR,
}
CLIENT_CLOSED_REQUEST = 499
"""The status logged for a request whose client left first (nginx's; nobody receives it)."""
# vLLM's (and OpenAI's) `type` for each status.
_TYPE_BY_STATUS: dict[int, str] = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
    405: "MethodNotAllowedError", 409: "ConflictError", 413: "RequestTooLargeError",
    429: "RateLimitError", 499: "ClientClosedRequest", 500: "InternalServerError",
    501: "NotImplementedError", 503: "ServiceUnavailableError", 504: "TimeoutError",
}


def http_status_for(exc: BaseException) -> int:
    """The status of an exception: by its class where HTTP says more than its gRPC code (404,
    413, 429, 503), else by the gRPC code it travels as; 500 for anything unexpected."""
    for cls, status in _STATUS_BY_CLASS:
        if isinstance(exc, cls):
            return status
    if isinstance(exc, EngineError):
        if exc.status_code == "CANCELLED":
            return CLIENT_CLOSED_REQUEST
        return _STATUS_BY_GRPC_CODE.get(exc.status_code, HTTPStatus.INTERNAL_SERVER_ERROR)
    if isinstance(exc, (ValidationError, RequestValidationError, RecursionError)):
        return HTTPStatus.BAD_REQUEST  # a RecursionError: input nested deeper than Python goes
    return HTTPStatus.INTERNAL_SERVER_ERROR


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """`vllm serve`'s error object."""
    error_type = _TYPE_BY_STATUS.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(exc: BaseException) -> Response:
    """The JSON answer for `exc`; the engine error's class name rides in a header, as in the
    gRPC trailing metadata."""
    status = http_status_for(exc)
    if status == HTTPStatus.INTERNAL_SERVER_ERROR and not isinstance(exc, EngineError):
        logger.exception("unexpected error in an HTTP request", exc_info=exc)
    message = validation_message(exc) if isinstance(
        exc, (ValidationError, RequestValidationError)) else (str(exc) or type(exc).__name__)
    if isinstance(exc, RecursionError):
        message = f"the request is nested too deeply to process ({message})"
    headers = {ERROR_TYPE_KEY: type(exc).__name__} if isinstance(exc, EngineError) else None
    return json_response(error_body(message, status), status, headers)


def validation_message(exc: ValidationError | RequestValidationError) -> str:
    """One line per problem: where, and what is wrong."""
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        lines.append(f"{where or 'body'}: {error.get('msg')}")
    return "invalid request: " + "; ".join(lines)


def stream_error_event(exc: BaseException) -> str:
    """What a stream that already started sends instead of a status (vLLM's form)."""
    status = http_status_for(exc)
    if status == HTTPStatus.INTERNAL_SERVER_ERROR and not isinstance(exc, EngineError):
        logger.exception("unexpected error in an HTTP stream", exc_info=exc)
    return f"data: {json.dumps(error_body(str(exc) or type(exc).__name__, status))}\n\n"


def json_response(content: object, status: int = 200, headers: dict[str, str] | None = None
                  ) -> Response:
    """Compact JSON. Logprobs are clamped to -9999.0 before they get here (as vLLM does), so
    no infinity reaches the wire."""
    body = json.dumps(content, ensure_ascii=False, separators=(",", ":"))
    try:
        data = body.encode()
    except UnicodeEncodeError:  # a lone surrogate of the request, echoed: JSON's \u escape
        data = json.dumps(content, separators=(",", ":")).encode()
    return Response(data, status_code=status, headers=headers, media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
    """Every failure of a route, of request parsing and of routing answers in the error JSON."""

    async def on_exception(request: Request, exc: Exception) -> Response:
        return error_response(exc)

    async def on_http_exception(request: Request, exc: StarletteHTTPException) -> Response:
        return json_response(error_body(str(exc.detail), exc.status_code), exc.status_code,
                             getattr(exc, "headers", None))

    app.add_exception_handler(Exception, on_exception)
    app.add_exception_handler(EngineError, on_exception)
    app.add_exception_handler(RequestValidationError, on_exception)
    app.add_exception_handler(ValidationError, on_exception)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
