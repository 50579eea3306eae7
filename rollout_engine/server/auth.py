"""Bearer-token authentication for the gRPC server (the bind-address rule is ServerConfig's)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection

import grpc

# The health service stays open so that orchestrators can probe readiness without a token.
OPEN_METHODS: frozenset[str] = frozenset(
    {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"}
)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls whose `authorization` metadata is not `Bearer <token>`."""

    def __init__(self, token: str, open_methods: Collection[str] = OPEN_METHODS) -> None:
        if not token:
            raise ValueError("the auth token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self._open_methods = frozenset(open_methods)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in self._open_methods:
            return handler
        if self._is_authorized(handler_call_details.invocation_metadata or ()):
            return handler
        return _denying_handler(handler)

    def _is_authorized(self, metadata: Collection[tuple[str, str | bytes]]) -> bool:
        for key, value in metadata:
            if key == "authorization":
                given = value if isinstance(value, bytes) else value.encode()
                return hmac.compare_digest(given, self._expected)
        return False


_DENIED = "missing or wrong auth token: send metadata `authorization: Bearer <token>`"


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind (unary/streaming) that fails with UNAUTHENTICATED."""

    async def deny_unary(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)

    async def deny_streaming(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
        yield  # pragma: no cover - makes this an async generator

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_streaming, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny_unary, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_streaming, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny_unary, **kwargs)
