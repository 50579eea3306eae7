"""Every error path of the server, pinned to its status code and engine error type (the table
of DESIGN "Conventions": INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, ...)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from rollout_engine.protocol import EngineError, error_from_status
from tests.e2e.server_process import start_server
from trainer_bridge import EngineClient, SamplingParams
from trainer_bridge.client import error_from_rpc

MAX_INFLIGHT, MAX_N = 6, 4
LONG = SamplingParams(max_tokens=100, ignore_eos=True)


@pytest.fixture(scope="module")
def small_server(tmp_path_factory, llama_dir):
    """A server with a tiny KV pool (128 tokens) and tight admission limits."""
    process = start_server(
        tmp_path_factory, llama_dir, "--num-blocks", "8", "--block-size", "16",
        "--max-inflight-requests", str(MAX_INFLIGHT), "--max-n", str(MAX_N),
    )
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def small_client(small_server):
    with EngineClient(small_server.address, timeout=60, max_retries=0) as client:
        client.wait_until_ready(30)
        yield client


@contextlib.contextmanager
def generating(client: EngineClient) -> Iterator[None]:
    stream = client.generate_stream([5, 6, 7], LONG)
    next(stream)
    try:
        yield
    finally:
        stream.close()


def released_kv(client: EngineClient) -> None:
    client.release_kv_cache_memory()
    try:
        client.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        client.wake_up(["kv_cache"])


def update_while_generating(client: EngineClient) -> None:
    with generating(client):
        client.update_weights({"model.norm.weight": torch.ones(64)}, transport="stream")


def raw_call(client: EngineClient, method: str, payload: bytes) -> None:
    """Send undecodable bytes as the request of `method`."""
    call = client._channel.unary_stream(  # a raw call on the client's channel
        f"/rollout.v1.RolloutEngine/{method}", request_serializer=lambda raw: raw,
        response_deserializer=lambda raw: raw,
    )
    try:
        list(call(payload, timeout=30))
    except grpc.RpcError as exc:
        raise error_from_rpc(exc) from None


def raw_sampling_params(client: EngineClient, **fields) -> None:
    stub = pb_grpc.RolloutEngineStub(client._channel)
    request = pb.GenerateBatchRequest(prompts=[pb.Prompt(text="hi")],
                                      sampling_params=pb.SamplingParams(**fields))
    try:
        list(stub.GenerateBatch(request, timeout=30))
    except grpc.RpcError as exc:
        raise error_from_rpc(exc) from None


CASES: dict[str, tuple[Callable[[EngineClient], object], str, str]] = {
    "negative temperature": (lambda c: raw_sampling_params(c, temperature=-1.0),
                             "INVALID_ARGUMENT", "InvalidRequestError"),
    "zero max_tokens": (lambda c: raw_sampling_params(c, max_tokens=0),
                        "INVALID_ARGUMENT", "InvalidRequestError"),
    "token id outside the vocabulary": (
        lambda c: c.generate([[5, 10**6]], SamplingParams(max_tokens=2)),
        "INVALID_ARGUMENT", "InvalidRequestError"),
    "empty prompt": (lambda c: c.generate([[]], SamplingParams(max_tokens=2)),
                     "INVALID_ARGUMENT", "InvalidRequestError"),
    "prompt past max_model_len": (lambda c: c.generate([[5] * 2000], SamplingParams(max_tokens=2)),
                                  "INVALID_ARGUMENT", "InvalidRequestError"),
    "undecodable message": (lambda c: raw_call(c, "GenerateBatch", b"\x0a\xff\xff\xff"),
                            "INVALID_ARGUMENT", "InvalidRequestError"),
    "n above --max-n": (lambda c: raw_sampling_params(c, n=2**31 - 1),
                        "INVALID_ARGUMENT", "InvalidRequestError"),
    "unknown sleep level": (lambda c: c.sleep(level=5), "INVALID_ARGUMENT", "InvalidRequestError"),
    "unknown memory tag": (lambda c: c.wake_up(["gpu"]), "INVALID_ARGUMENT", "InvalidRequestError"),
    "refused weight manifest": (
        lambda c: c.update_weights({"no.such.weight": torch.ones(2)}, transport="stream"),
        "INVALID_ARGUMENT", "WeightUpdateError"),
    "request larger than the KV pool": (
        lambda c: c.generate([[5] * 100], SamplingParams(max_tokens=100)),
        "RESOURCE_EXHAUSTED", "OutOfBlocksError"),
    "prompts x n past the admission limit": (
        lambda c: c.generate([[5, 6]] * 2, SamplingParams(n=MAX_N, max_tokens=2)),
        "RESOURCE_EXHAUSTED", "AdmissionError"),
    "generate with the KV cache released": (released_kv, "FAILED_PRECONDITION",
                                            "EngineSleepingError"),
    "weight update while generating": (update_while_generating, "FAILED_PRECONDITION",
                                       "EngineBusyError"),
    "deadline passed": (lambda c: c.generate([[5, 6]], LONG, timeout=0.05),
                        "DEADLINE_EXCEEDED", ""),
}


@pytest.mark.parametrize("case", list(CASES))
def test_status_code_of_each_error_path(small_client, case):
    trigger, code, error_type = CASES[case]
    with pytest.raises(EngineError) as failure:
        trigger(small_client)
    assert failure.value.code == code, failure.value
    assert failure.value.error_type == (error_type or failure.value.error_type)
    expected_cls = type(error_from_status(code, "", error_type))
    assert type(failure.value) is expected_cls
    # ... and the server goes on serving.
    assert len(small_client.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].outputs) == 1


def test_a_huge_n_is_refused_at_once_and_costs_nothing(small_client, small_server):
    """A 20-byte request asking for 2**31 - 1 samples used to be expanded on the engine thread
    until the server died; now it is refused before anything is built."""
    before_s = small_server.cpu_time_s()
    with pytest.raises(EngineError, match="max-n"):
        raw_sampling_params(small_client, n=2**31 - 1)
    assert small_server.cpu_time_s() - before_s < 0.5
    assert small_client.info().num_unfinished_requests == 0


def test_admission_counts_samples_not_prompts(small_client):
    # 2 prompts x n=4 = 8 samples > 6: refused, though it is only 2 prompts.
    with pytest.raises(EngineError, match="in-flight requests"):
        small_client.generate([[5, 6]] * 2, SamplingParams(n=4, max_tokens=2))
    outputs = small_client.generate([[5, 6]] * 2, SamplingParams(n=3, max_tokens=2))
    assert [len(o.outputs) for o in outputs] == [3, 3]


def test_an_unreachable_server_is_unavailable():
    with EngineClient("127.0.0.1:1", max_retries=1) as client, pytest.raises(EngineError) as failure:
        client.info()
    assert failure.value.code == "UNAVAILABLE"
