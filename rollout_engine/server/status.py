"""The one place where engine exceptions become gRPC statuses: handler decorators that abort
the call with the code the exception names (rollout_engine.protocol) and its type, and request
decoding that turns an undecodable message into INVALID_ARGUMENT instead of INTERNAL."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from rollout_engine.protocol import ERROR_TYPE_KEY, EngineError, InvalidRequestError

logger = logging.getLogger(__name__)


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """An EngineError's own code; INTERNAL for anything the engine did not raise on purpose."""
    if isinstance(exc, EngineError):
        return grpc.StatusCode[exc.status_code]
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the status of `exc`; the message says what happened."""
    if not isinstance(exc, EngineError):
        logger.exception("unexpected error in a call", exc_info=exc)
    message = str(exc) or type(exc).__name__
    await context.abort(
        status_code_for(exc), message, trailing_metadata=((ERROR_TYPE_KEY, type(exc).__name__),)
    )


@dataclass(frozen=True)
class MalformedMessage:
    """A request message that could not be decoded."""

    type_name: str
    reason: str

    def error(self) -> InvalidRequestError:
        return InvalidRequestError(f"cannot decode the {self.type_name} message: {self.reason}")


def safe_deserializer(decode: Callable[[bytes], Any], type_name: str) -> Callable[[bytes], Any]:
    """`decode`, but a message it cannot decode becomes a MalformedMessage for the handler."""

    def deserialize(raw: bytes) -> Any:
        try:
            return decode(raw)
        except Exception as exc:  # noqa: BLE001 - any decode failure is the sender's input
            return MalformedMessage(type_name, f"{type(exc).__name__}: {exc}")

    return deserialize


def check_decoded(message: Any) -> Any:
    """The message itself; InvalidRequestError if it could not be decoded."""
    if isinstance(message, MalformedMessage):
        raise message.error()
    return message


def unary(method: Callable) -> Callable:
    """A unary handler whose exceptions end the call with their status."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, check_decoded(request), context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes the call's status
            await abort_with(context, exc)

    return wrapper


def streaming(method: Callable) -> Callable:
    """A response-streaming handler whose exceptions end the call with their status."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            async for message in method(self, check_decoded(request), context):
                yield message
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes the call's status
            await abort_with(context, exc)

    return wrapper
