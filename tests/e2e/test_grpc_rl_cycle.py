"""The RL cycle over gRPC: generate, sleep, wake weights, update weights, wake KV, generate."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from safetensors.torch import load_file

from protos import rollout_pb2 as pb
from tests.e2e.server_process import AUTH, AUTH_TOKEN, start_server, wait_for
from tests.integration.hf_oracle import hf_greedy, load_hf_model
from trainer_bridge import (
    EngineClient,
    EngineSleepingError,
    FailedPreconditionError,
    InvalidArgumentError,
    SamplingParams,
)
from trainer_bridge.transports import WeightManifest, manifest_request

PROMPTS = [[3, 14, 15, 92, 65], [27, 18, 28, 18, 28, 45, 90]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def rl_server(tmp_path_factory, llama_dir):
    process = start_server(tmp_path_factory, llama_dir, "--auth-token", AUTH_TOKEN,
                           "--shutdown-grace-s", "20")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def rl_client(rl_server):
    with EngineClient(rl_server.address, auth_token=AUTH_TOKEN, timeout=60) as engine_client:
        engine_client.wait_until_ready(30)
        yield engine_client


def greedy_tokens(client) -> list[list[int]]:
    outputs = client.generate(PROMPTS, GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


def hf_tokens(model_dir) -> list[list[int]]:
    return [hf_greedy(str(model_dir), p, GREEDY.max_tokens) for p in PROMPTS]


def weights_of(model_dir, kind: str):
    """Named tensors as a trainer would hold them: a module or a plain dict."""
    if kind == "module":
        return load_hf_model(str(model_dir))
    return load_file(str(model_dir / "model.safetensors"))


SMALL_BUCKET_BYTES = 48 * 1024  # tensors span buckets; shared buffers are reused after acks


@pytest.mark.parametrize(
    ("transport", "seed", "kind", "bucket_bytes"),
    [
        ("stream", 1, "module", SMALL_BUCKET_BYTES),
        ("shm", 2, "dict", SMALL_BUCKET_BYTES),
        ("auto", 1, "dict", None),
    ],
)
def test_rl_cycle(rl_client, other_model_dirs, transport, seed, kind, bucket_bytes):
    new_model = other_model_dirs[seed]
    before = rl_client.generate(PROMPTS, GREEDY)
    version = before[0].outputs[0].weight_version
    assert greedy_tokens(rl_client) != hf_tokens(new_model), "the models must differ"

    assert rl_client.sleep(level=2) == 0
    state = rl_client.memory_state()
    assert state.is_sleeping and not state.weights_valid
    with pytest.raises(EngineSleepingError, match="wake_up"):
        rl_client.generate(PROMPTS, GREEDY)

    rl_client.wake_up(["weights"])
    options = {"bucket_bytes": bucket_bytes} if bucket_bytes else {}
    new_version = rl_client.update_weights(weights_of(new_model, kind), transport=transport,
                                           **options)
    assert new_version == version + 1
    with pytest.raises(FailedPreconditionError, match="kv_cache"):
        rl_client.generate(PROMPTS, GREEDY)
    rl_client.wake_up(["kv_cache"])

    after = rl_client.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in after] == hf_tokens(new_model)
    assert {o.outputs[0].weight_version for o in after} == {new_version}
    assert rl_client.info().weight_version == new_version


def test_sleep_level_1_keeps_weights(rl_client):
    expected = greedy_tokens(rl_client)
    version = rl_client.info().weight_version
    rl_client.sleep(level=1)
    assert rl_client.memory_state().tags["weights"].state == "offloaded"
    rl_client.wake_up()
    assert greedy_tokens(rl_client) == expected
    assert rl_client.info().weight_version == version


def test_release_kv_and_reset_prefix_cache(rl_client):
    expected = greedy_tokens(rl_client)
    rl_client.release_kv_cache_memory()
    with pytest.raises(EngineSleepingError, match="kv_cache"):
        rl_client.generate(PROMPTS, GREEDY)
    rl_client.wake_up(["kv_cache"])
    rl_client.reset_prefix_cache()
    assert greedy_tokens(rl_client) == expected


def test_sleep_aborts_running_requests(rl_client):
    stream = rl_client.generate_stream(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
    next(stream)
    assert rl_client.sleep(level=1, mode="abort") == 1
    final = list(stream)[-1]
    assert final.outputs[0].finish_reason == "abort"
    rl_client.wake_up()


def test_update_cut_off_midway_refuses_generation_until_a_full_update(
    rl_server, rl_client, other_model_dirs
):
    weights = load_file(str(other_model_dirs[2] / "model.safetensors"))
    named = list(weights.items())
    first_name, first = named[0]
    release = threading.Event()

    def requests():
        yield manifest_request(WeightManifest.of(named), "stream")
        half = first.reshape(-1).view(torch.uint8)[: first.nbytes // 2]
        piece = pb.TensorPiece(name=first_name, tensor_offset=0, num_bytes=half.numel())
        yield pb.UpdateWeightsRequest(chunk=pb.StreamChunk(pieces=[piece],
                                                           data=half.numpy().tobytes()))
        release.wait(30)

    with grpc.insecure_channel(rl_server.address) as channel:
        from protos import rollout_pb2_grpc

        call = rollout_pb2_grpc.RolloutEngineStub(channel).UpdateWeights(requests(), metadata=AUTH)
        assert next(call).manifest_accepted
        call.cancel()  # the trainer dies mid-update
        release.set()

    assert wait_for(lambda: not rl_client.memory_state().weights_valid)
    with pytest.raises(FailedPreconditionError, match="cut off"):
        rl_client.generate(PROMPTS, GREEDY)
    # A partial manifest is refused while the weights are inconsistent.
    with pytest.raises(InvalidArgumentError, match="every parameter"):
        rl_client.update_weights(dict(named[:1]), transport="stream")
    rl_client.update_weights(weights, transport="shm")
    assert greedy_tokens(rl_client) == hf_tokens(other_model_dirs[2])


def test_sigterm_drains_in_flight_calls_and_exits_zero(rl_server, rl_client):
    stream = rl_client.generate_stream(PROMPTS[1], SamplingParams(max_tokens=60, ignore_eos=True))
    next(stream)
    rl_server.process.terminate()
    final = list(stream)[-1]
    assert final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == 60
    assert rl_server.process.wait(30) == 0
    assert "shutting down" in rl_server.log()
