"""The asyncio gRPC server (RolloutEngine, health, reflection); engine errors -> status codes."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from rollout_engine import server_convert as convert
from rollout_engine.errors import (
    EngineError,
    EngineSleepingError,
    InvalidRequestError,
    OutOfBlocksError,
    WeightUpdateError,
)
from rollout_engine.server_auth import BearerTokenInterceptor, check_bind_is_safe
from rollout_engine.server_engine_loop import EngineLoop, OutputSink
from rollout_engine.server_weights import WeightUpdateReceiver
from rollout_engine.server_wire import decode_update_request

if TYPE_CHECKING:
    from rollout_engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutEngine"].full_name
ERROR_TYPE_KEY = "rollout-error-type"
"""Trailing metadata that names the engine exception behind a failed call."""


@dataclass(frozen=True)
class ServerConfig:
    """How the gRPC server listens and admits work."""

    host: str = "127.0.0.1"
    """Address to bind; anything but loopback needs an auth token (or allow_insecure_remote)."""
    port: int = 50051
    """TCP port; 0 picks a free one (the ready line says which)."""
    max_inflight_requests: int = 4096
    """Prompts admitted at once across all calls; more get RESOURCE_EXHAUSTED."""
    auth_token: str | None = None
    """If set, every call but the health check needs `authorization: Bearer <token>`."""
    allow_insecure_remote: bool = False
    """Allow a non-loopback bind without a token (trusted networks only)."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest gRPC message either way."""
    shutdown_grace_s: float = 10.0
    """On SIGTERM, in-flight calls get this long to finish before they are aborted."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_inflight_requests < 1:
            raise ValueError("max_inflight_requests must be >= 1")
        if self.max_message_bytes < 1024 * 1024:
            raise ValueError("max_message_bytes must be at least 1 MiB")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")
        check_bind_is_safe(self.host, self.auth_token, self.allow_insecure_remote)


# ------------------------------------------------------------------------------- errors


class AdmissionError(EngineError):
    """The server is at its in-flight request limit (RESOURCE_EXHAUSTED)."""



def status_code_for(exc: EngineError, in_weight_update: bool = False) -> grpc.StatusCode:
    """The one place where engine exceptions become gRPC status codes."""
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, EngineSleepingError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, (OutOfBlocksError, AdmissionError)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, WeightUpdateError):
        # A refused update is the caller's input; outside an update it means the weights
        # are inconsistent after an update that was cut off.
        if in_weight_update:
            return grpc.StatusCode.INVALID_ARGUMENT
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, in_weight_update: bool):
    if isinstance(exc, EngineError):
        code = status_code_for(exc, in_weight_update)
    else:
        logger.exception("unexpected error in a call", exc_info=exc)
        code = grpc.StatusCode.INTERNAL
    await context.abort(code, str(exc) or type(exc).__name__,
                        trailing_metadata=((ERROR_TYPE_KEY, type(exc).__name__),))


def _unary(method: Callable) -> Callable:
    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc, in_weight_update=False)

    return wrapper


def _streaming(in_weight_update: bool = False) -> Callable:
    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        async def wrapper(self, request, context):
            try:
                async for message in method(self, request, context):
                    yield message
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                await _abort(context, exc, in_weight_update)

        return wrapper

    return decorate


# ------------------------------------------------------------------------------ service


class RolloutEngineServicer(pb_grpc.RolloutEngineServicer):
    """Translates calls into engine-thread commands; holds no engine state of its own."""

    def __init__(self, engine_loop: EngineLoop, config: ServerConfig) -> None:
        self.engine_loop = engine_loop
        self.engine: LLMEngine = engine_loop.engine
        self.config = config
        self.num_inflight_requests = 0
        self._ids = itertools.count()

    # ------------------------------------------------------------------------ generation
    @_streaming()
    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[Any]:
        prompt = convert.prompt_from_proto(request.prompt)
        params = convert.sampling_params_from_proto(request.sampling_params)
        stream_deltas = request.stream_deltas if request.HasField("stream_deltas") else True
        state = convert.GenerateStreamState(stream_deltas)
        request_id = f"gen-{next(self._ids)}"
        sink = OutputSink(finals_only=not stream_deltas)
        async with self._admitted(1):
            finished = False
            try:
                # Inside the try: a call cancelled while the add runs still aborts it.
                await self.engine_loop.add_requests([(request_id, prompt, params)], sink)
                while not finished:
                    output = await sink.get()
                    finished = output.finished
                    message = state.response(output)
                    if message is not None:
                        yield message
            finally:
                if not finished:  # cancelled, deadline passed, or the stream broke
                    self.engine_loop.abort([request_id])

    @_streaming()
    async def GenerateBatch(self, request: pb.GenerateBatchRequest, context) -> AsyncIterator[Any]:
        if not request.prompts:
            raise InvalidRequestError("GenerateBatch needs at least one prompt")
        prompts = [convert.prompt_from_proto(p) for p in request.prompts]
        params = convert.batch_sampling_params(request)
        base_id = f"batch-{next(self._ids)}"
        request_ids = [f"{base_id}:{i}" for i in range(len(prompts))]
        state = convert.BatchStreamState(request_ids)
        sink = OutputSink(finals_only=True)
        async with self._admitted(len(prompts)):
            pending = set(request_ids)
            try:
                await self.engine_loop.add_requests(list(zip(request_ids, prompts, params)), sink)
                while pending:
                    output = await sink.get()
                    if output.finished:
                        pending.discard(output.request_id)
                    for message in convert.batch_responses(state.new_completions(output)):
                        yield message
            finally:
                if pending:
                    self.engine_loop.abort(sorted(pending))

    # ---------------------------------------------------------------------- memory control
    @_unary
    async def Sleep(self, request: pb.SleepRequest, context) -> pb.SleepResponse:
        level, mode = request.level or 1, request.mode or "abort"
        sleep = functools.partial(self.engine.sleep, level=level, mode=mode)
        num_ended = await self.engine_loop.call_dispatching(sleep)
        if mode == "wait":
            return pb.SleepResponse(num_drained_requests=num_ended)
        return pb.SleepResponse(num_aborted_requests=num_ended)

    @_unary
    async def WakeUp(self, request: pb.WakeUpRequest, context) -> pb.WakeUpResponse:
        tags = list(request.tags) or None
        await self.engine_loop.call(functools.partial(self.engine.wake_up, tags=tags))
        return pb.WakeUpResponse()

    @_unary
    async def ReleaseKVCache(self, request, context) -> pb.ReleaseKVCacheResponse:
        num_ended = await self.engine_loop.call_dispatching(self.engine.release_kv_cache_memory)
        return pb.ReleaseKVCacheResponse(num_aborted_requests=num_ended)

    @_unary
    async def ResetPrefixCache(self, request, context) -> pb.ResetPrefixCacheResponse:
        await self.engine_loop.call(self.engine.reset_prefix_cache)
        return pb.ResetPrefixCacheResponse()

    # ---------------------------------------------------------------------- weight updates
    @_streaming(in_weight_update=True)
    async def UpdateWeights(self, request_iterator, context) -> AsyncIterator[Any]:
        # A second update supersedes an open one: the engine aborts the older session, whose
        # next write then fails, so two streams can never interleave writes.
        async for message in WeightUpdateReceiver(self.engine_loop).run(request_iterator):
            yield message

    # ----------------------------------------------------------------------- introspection
    @_unary
    async def GetInfo(self, request, context) -> pb.GetInfoResponse:
        counters = {
            **self.engine_loop.counters(),
            "num_inflight_requests": self.num_inflight_requests,
            "max_inflight_requests": self.config.max_inflight_requests,
        }
        return await self.engine_loop.call(convert.info_to_proto, self.engine, counters)

    @_unary
    async def GetMemoryState(self, request, context) -> pb.GetMemoryStateResponse:
        return await self.engine_loop.call(convert.memory_state_to_proto, self.engine)

    # --------------------------------------------------------------------------- admission
    def _admitted(self, num_requests: int) -> _Admission:
        return _Admission(self, num_requests)


class _Admission:
    """Counts prompts in flight; refuses those past `max_inflight_requests`."""

    def __init__(self, servicer: RolloutEngineServicer, num_requests: int) -> None:
        self._servicer, self._num_requests = servicer, num_requests

    async def __aenter__(self) -> None:
        servicer, limit = self._servicer, self._servicer.config.max_inflight_requests
        if servicer.num_inflight_requests + self._num_requests > limit:
            raise AdmissionError(
                f"the server is at its limit of {limit} in-flight requests "
                f"({servicer.num_inflight_requests} running, {self._num_requests} asked); "
                "retry later or start the server with a larger --max-inflight-requests"
            )
        servicer.num_inflight_requests += self._num_requests

    async def __aexit__(self, *exc_info: object) -> None:
        self._servicer.num_inflight_requests -= self._num_requests


# ------------------------------------------------------------------------------- serving


def add_rollout_service(servicer: RolloutEngineServicer, server) -> None:
    """Register the service from its descriptor, as the generated `add_..._to_server` does,
    but with UpdateWeights' chunk-aware request deserializer."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["RolloutEngine"].methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        make_handler = _HANDLER_FACTORIES[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make_handler(
            getattr(servicer, method.name),
            request_deserializer=(
                decode_update_request if method.name == "UpdateWeights" else request_cls.FromString
            ),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def build_server(engine_loop: EngineLoop, config: ServerConfig):
    """A grpc.aio server with the service, health and reflection; not yet bound or started."""
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
    server = grpc.aio.server(interceptors=interceptors, options=options)
    add_rollout_service(RolloutEngineServicer(engine_loop, config), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return server, health_servicer


async def serve(engine: LLMEngine, config: ServerConfig, model_name: str = "") -> None:
    """Serve until SIGTERM or SIGINT, then drain for `shutdown_grace_s` and return."""
    loop = asyncio.get_running_loop()
    engine_loop = EngineLoop(engine, loop)
    engine_loop.start()
    server, health_servicer = build_server(engine_loop, config)
    host = f"[{config.host}]" if ":" in config.host else config.host
    try:
        port = server.add_insecure_port(f"{host}:{config.port}")
    except RuntimeError as exc:
        engine_loop.stop()
        raise OSError(f"cannot bind {host}:{config.port}: {exc}") from None
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"rollout-engine serving {model_name or engine.config.model_config.model} "
          f"on {host}:{port}", file=sys.stderr, flush=True)
    await stop.wait()
    logger.warning("shutting down: draining in-flight calls for up to %.1f s",
                   config.shutdown_grace_s)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(config.shutdown_grace_s)
    engine_loop.stop()


def run_server(engine: LLMEngine, config: ServerConfig, model_name: str = "") -> int:
    """Blocking entry point of `rollout-engine serve`; returns the exit status."""
    asyncio.run(serve(engine, config, model_name))
    return 0
