"""The server process: the RolloutEngine gRPC service, health and reflection, the optional HTTP
front-end (`vllm serve`'s API) on the same event loop, both over one `AsyncEngine`, and their
lifetime."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import rollout_pb2 as pb
from protos.weight_codec import decode_update_request
from rollout_engine.protocol import SERVICE_NAME
from rollout_engine.server.async_engine import AsyncEngine
from rollout_engine.server.auth import BearerTokenInterceptor
from rollout_engine.server.servicer import RolloutEngineServicer
from rollout_engine.server.status import safe_deserializer

if TYPE_CHECKING:
    from rollout_engine.config import ServerConfig

logger = logging.getLogger(__name__)
_HEALTH_INTERVAL_S = 0.2

_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_rollout_service(servicer: RolloutEngineServicer, server) -> None:
    """Register the service from its descriptor, as the generated `add_..._to_server` does,
    but with UpdateWeights' chunk-aware request deserializer, and every deserializer safe."""
    service = pb.DESCRIPTOR.services_by_name["RolloutEngine"]
    assert service.full_name == SERVICE_NAME, (service.full_name, SERVICE_NAME)
    handlers = {}
    for method in service.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        make_handler = _HANDLER_FACTORIES[(method.client_streaming, method.server_streaming)]
        decode = decode_update_request if method.name == "UpdateWeights" else request_cls.FromString
        handlers[method.name] = make_handler(
            getattr(servicer, method.name),
            request_deserializer=safe_deserializer(decode, method.input_type.name),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def build_server(engine: AsyncEngine, config: ServerConfig):
    """A grpc.aio server with the service, health and reflection; not yet bound or started."""
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
    server = grpc.aio.server(interceptors=interceptors, options=options)
    add_rollout_service(RolloutEngineServicer(engine, config.trust_request_chat_template), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return server, health_servicer


async def serve(engine: AsyncEngine, config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT, then drain for `shutdown_grace_s`, shut the engine down
    and return."""
    engine.start()
    try:
        await _serve_until_stopped(engine, config)
    finally:
        engine.shutdown()


async def _serve_until_stopped(engine: AsyncEngine, config: ServerConfig) -> None:
    server, health_servicer = build_server(engine, config)
    host = f"[{config.host}]" if ":" in config.host else config.host
    try:
        port = server.add_insecure_port(f"{host}:{config.port}")
    except RuntimeError as exc:
        raise OSError(f"cannot bind {host}:{config.port}: {exc}") from None
    http = _http_front_end(engine, config)
    engine.set_kv_transfer_address(advertised_address(config.host, port))
    await server.start()
    if http is not None:
        await http.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    health_task = asyncio.create_task(report_health(engine, health_servicer, config))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if http is not None:  # first: whoever reads the gRPC ready line finds this one too
        print(f"rollout-engine HTTP (vllm serve API) on http://{host}:{http.port}",
              file=sys.stderr, flush=True)
    print(f"rollout-engine serving {engine.model.served_model_name} on {host}:{port}",
          file=sys.stderr, flush=True)
    await stop.wait()
    logger.warning("shutting down: draining in-flight calls for up to %.1f s",
                   config.shutdown_grace_s)
    health_task.cancel()
    await health_servicer.enter_graceful_shutdown()
    stopping = [server.stop(config.shutdown_grace_s)]
    if http is not None:
        stopping.append(http.stop(config.shutdown_grace_s))
    await asyncio.gather(*stopping)


def _http_front_end(engine: AsyncEngine, config: ServerConfig):
    """The HTTP front-end, its port bound, if `config.http_port` asks for one (FastAPI is
    imported only then)."""
    if config.http_port is None:
        return None
    from rollout_engine.server.http.app import HttpFrontEnd

    return HttpFrontEnd(engine, config)


def advertised_address(host: str, port: int) -> str:
    """How peers reach this server: the bound host, or this machine's name for a wildcard."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def report_health(engine: AsyncEngine, health_servicer, config: ServerConfig) -> None:
    """Keep the health status (of "" and of the RolloutEngine service) true: NOT_SERVING while
    the engine thread is dead or one step or command has run for `engine_stall_s`, SERVING
    again once it is responsive."""
    status = health_pb2.HealthCheckResponse.SERVING  # as serve() set it
    while True:
        is_serving = engine.is_responsive(config.engine_stall_s)
        new_status = (health_pb2.HealthCheckResponse.SERVING if is_serving
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
        if new_status != status:
            logger.warning("health: %s", health_pb2.HealthCheckResponse.ServingStatus.Name(
                new_status))
            for service in ("", SERVICE_NAME):
                await health_servicer.set(service, new_status)
            status = new_status
        await asyncio.sleep(_HEALTH_INTERVAL_S)


def run_server(engine: AsyncEngine, config: ServerConfig) -> int:
    """Blocking entry point of `rollout-engine serve`; returns the exit status."""
    try:
        asyncio.run(serve(engine, config))
    finally:
        engine.shutdown()  # if serve never ran: the other tensor-parallel ranks' processes too
    return 0
