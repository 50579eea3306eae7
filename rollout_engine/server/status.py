"""The one place where engine exceptions become gRPC statuses: handler decorators that abort
the call with the code the exception names (rollout_engine.protocol) and its type."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import grpc

from rollout_engine.protocol import ERROR_TYPE_KEY, EngineError

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


def unary(method: Callable) -> Callable:
    """A unary handler whose exceptions end the call with their status."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    return wrapper


def streaming(method: Callable) -> Callable:
    """A response-streaming handler whose exceptions end the call with their status."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            async for message in method(self, request, context):
                yield message
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    return wrapper
