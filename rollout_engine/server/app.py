"""The gRPC server process: the RolloutEngine service, health and reflection, and its lifetime."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import rollout_pb2 as pb
from rollout_engine.protocol import SERVICE_NAME
from rollout_engine.server.auth import BearerTokenInterceptor
from rollout_engine.server.chunk_decoding import decode_update_request
from rollout_engine.server.engine_loop import EngineLoop
from rollout_engine.server.servicer import RolloutEngineServicer

if TYPE_CHECKING:
    from rollout_engine.config import ServerConfig
    from rollout_engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_rollout_service(servicer: RolloutEngineServicer, server) -> None:
    """Register the service from its descriptor, as the generated `add_..._to_server` does,
    but with UpdateWeights' chunk-aware request deserializer."""
    service = pb.DESCRIPTOR.services_by_name["RolloutEngine"]
    assert service.full_name == SERVICE_NAME, (service.full_name, SERVICE_NAME)
    handlers = {}
    for method in service.methods:
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
