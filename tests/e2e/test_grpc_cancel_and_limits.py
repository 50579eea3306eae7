"""Cancelled streams and passed deadlines free their KV blocks; admission limit; auth; health."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.server_process import AUTH, wait_for
from trainer_bridge import (
    DeadlineExceededError,
    EngineClient,
    ResourceExhaustedError,
    SamplingParams,
    UnauthenticatedError,
)

LONG = SamplingParams(n=2, temperature=1.0, max_tokens=200, ignore_eos=True, seed=0)
# Work a 0.3 s deadline cuts short on a fast machine too (the tiny model steps in well under a
# millisecond: 4 x 2 x 200 tokens once finished within it).
DEADLINE_WORK = SamplingParams(n=16, temperature=1.0, max_tokens=220, ignore_eos=True, seed=0)
PROMPTS = [[7 + i, 8, 9, 10, 11 + i, 12] * 4 for i in range(4)]


def blocks_back_to_initial(client, num_blocks: int) -> bool:
    info = client.info()
    return info.num_free_blocks == num_blocks and info.num_inflight_requests == 0


def test_cancel_mid_stream_frees_blocks(client):
    num_blocks = client.info().num_blocks
    stream = client.generate_stream(PROMPTS[0], LONG)
    snapshot = next(stream)
    snapshot = next(stream)
    assert not snapshot.finished
    assert client.info().num_free_blocks < num_blocks, "the running request holds blocks"
    stream.close()  # cancels the call
    assert wait_for(lambda: blocks_back_to_initial(client, num_blocks))


def test_deadline_frees_blocks(client):
    num_blocks = client.info().num_blocks
    with pytest.raises(DeadlineExceededError):
        client.generate(PROMPTS, DEADLINE_WORK, timeout=0.3)
    assert wait_for(lambda: blocks_back_to_initial(client, num_blocks))
    with pytest.raises(DeadlineExceededError):
        list(client.generate_stream(PROMPTS[1], DEADLINE_WORK, timeout=0.3))
    assert wait_for(lambda: blocks_back_to_initial(client, num_blocks))


def test_admission_limit(client):
    limit = client.info().max_inflight_requests
    too_many = [[5, 6, 7]] * (limit + 1)
    with pytest.raises(ResourceExhaustedError, match="in-flight requests"):
        client.generate(too_many, SamplingParams(max_tokens=1))
    # Admitted work counts against the limit while it runs.
    stream = client.generate_stream(PROMPTS[2], LONG)
    next(stream)
    try:
        assert client.info().num_inflight_requests == LONG.n  # samples, not prompts
        with pytest.raises(ResourceExhaustedError):
            client.generate([[5, 6, 7]] * limit, SamplingParams(max_tokens=1))
    finally:
        stream.close()
    assert len(client.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=1))) == 4


def test_calls_without_the_token_are_unauthenticated(server):
    for token in (None, "wrong-token"):
        with EngineClient(server.address, auth_token=token, max_retries=0) as anonymous:
            with pytest.raises(UnauthenticatedError, match="auth token"):
                anonymous.info()
            with pytest.raises(UnauthenticatedError):
                anonymous.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
            with pytest.raises(UnauthenticatedError):
                list(anonymous.generate_stream([1, 2, 3], SamplingParams(max_tokens=2)))
            with pytest.raises(UnauthenticatedError):
                anonymous.update_weights({"model.norm.weight": torch.ones(64)},
                                         transport="stream")
            with pytest.raises(UnauthenticatedError):
                anonymous.sleep(level=2)
            anonymous.wait_until_ready(10)  # the health service stays open


def test_health_and_reflection(server, client):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "rollout.v1.RolloutEngine"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # Reflection needs the token like every other service.
    with grpc.insecure_channel(server.address) as channel:
        authed = grpc.intercept_channel(channel, _AuthInterceptor())
        services = ProtoReflectionDescriptorDatabase(authed).get_services()
    assert "rollout.v1.RolloutEngine" in services
    assert "grpc.health.v1.Health" in services


class _AuthInterceptor(grpc.StreamStreamClientInterceptor):
    def intercept_stream_stream(self, continuation, call_details, request_iterator):
        return continuation(_Details(call_details, AUTH), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base, metadata) -> None:
        self.method, self.timeout, self.credentials = base.method, base.timeout, base.credentials
        self.wait_for_ready, self.compression = base.wait_for_ready, base.compression
        self.metadata = metadata
