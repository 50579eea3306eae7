"""The HTTP front-end (`serve --http-port`): `vllm serve`'s API as a FastAPI app, served by
uvicorn as a task of the gRPC server's event loop, over the same `AsyncEngine`.

    front_end = HttpFrontEnd(engine, config)  # binds the port
    await front_end.start()    # serving once this returns
    ...
    await front_end.stop(grace_s)
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from rollout_engine.server.http import (
    chat,
    completions,
    control,
    info,
    lora_adapters,
    responses,
    tokenize,
)
from rollout_engine.server.http.context import ServingContext
from rollout_engine.server.http.error_responses import (
    UnauthorizedError,
    error_response,
    install_error_handlers,
)

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

    from rollout_engine.config import ServerConfig
    from rollout_engine.server.async_engine import AsyncEngine

logger = logging.getLogger(__name__)
UNAUTHENTICATED_PATHS = frozenset({"/health"})
"""What a load balancer probes without the API key (as gRPC's health check)."""


def build_app(serving: ServingContext) -> FastAPI:
    app = FastAPI(title="rollout-engine (vllm serve API)", docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.serving = serving
    app.state.responses = responses.ResponseStore()  # for previous_response_id
    for module in (info, completions, chat, responses, tokenize):
        app.include_router(module.router)
    app.include_router(control.weight_transfer_router)
    if serving.config.enable_tokenizer_info_endpoint:
        app.include_router(tokenize.tokenizer_info_router)
    if serving.control_endpoints_enabled:
        app.include_router(control.router)
        app.include_router(lora_adapters.router)
    install_error_handlers(app)
    if serving.config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=serving.config.api_key)
    return app


class ApiKeyMiddleware:
    """`Authorization: Bearer <api key>` on every request but the health check."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in UNAUTHENTICATED_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                response = error_response(UnauthorizedError(
                    "missing or wrong API key: send `Authorization: Bearer <key>` with the "
                    "server's --api-key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Server(uvicorn.Server):
    """Leaves SIGTERM and SIGINT to `serve()`, which stops gRPC and HTTP together."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


class HttpFrontEnd:
    """The app, its socket (bound on construction: the port is known, and a taken port fails,
    before anything is served) and the uvicorn server running it on the current loop."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.serving = ServingContext.build(engine, config)
        self._socket = _bind(config.host, config.http_port or 0)
        self.port: int = self._socket.getsockname()[1]
        uvicorn_config = uvicorn.Config(
            build_app(self.serving), lifespan="off", access_log=False, log_level="warning",
            timeout_graceful_shutdown=int(config.shutdown_grace_s) or 1,
            timeout_keep_alive=30)
        self._server = _Server(uvicorn_config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise OSError("the HTTP server stopped before it started")
            await asyncio.sleep(0.01)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let requests in flight finish for up to `grace_s`, then close."""
        if self._task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace_s + 5.0)
        except TimeoutError:
            self._server.force_exit = True
            await self._task


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind the HTTP port {host}:{port}: {exc}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock
