"""Bad input gets INVALID_ARGUMENT with a message, and the server keeps serving everyone."""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from protos import rollout_pb2 as pb
from rollout_engine import SamplingParams as EngineSamplingParams
from tests.e2e.server_process import AUTH
from trainer_bridge import FailedPreconditionError, InvalidArgumentError, SamplingParams

PROMPT = [11, 22, 33, 44, 55]
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate([PROMPT], EngineSamplingParams(**GREEDY))[0].outputs[0].token_ids


@pytest.fixture
def still_serving(client, reference):
    """After the test: same weights, same version, same greedy output, nothing left running."""
    version = client.info().weight_version
    yield
    (output,) = client.generate([PROMPT], SamplingParams(**GREEDY))
    assert output.outputs[0].token_ids == reference
    info = client.info()
    assert info.weight_version == version
    assert info.weights_valid and not info.is_sleeping
    assert info.num_inflight_requests == 0


BAD_PARAMS = {
    "negative_temperature": ({"temperature": -1.0}, "temperature"),
    "nan_temperature": ({"temperature": math.nan}, "temperature"),
    "top_p_zero": ({"top_p": 0.0}, "top_p"),
    "top_k_zero": ({"top_k": 0}, "top_k"),
    "n_zero": ({"n": 0}, "n must be"),
    "max_tokens_zero": ({"max_tokens": 0}, "max_tokens"),
    "negative_stop_id": ({"stop_token_ids": [-3]}, "stop_token_ids"),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_malformed_sampling_params(client, still_serving, case):
    fields, words = BAD_PARAMS[case]
    with pytest.raises(InvalidArgumentError, match=words):
        client.generate([PROMPT], SamplingParams(**fields))
    with pytest.raises(InvalidArgumentError, match=words):
        list(client.generate_stream(PROMPT, SamplingParams(**fields)))


@pytest.mark.parametrize("prompt", [[5, 512, 7], [5, -1], [2**40]], ids=["vocab", "neg", "huge"])
def test_out_of_vocab_token_ids(client, still_serving, prompt):
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        client.generate([PROMPT, prompt], SamplingParams(**GREEDY))


def test_oversize_and_empty_prompts(client, still_serving):
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        client.generate([list(range(3, 300))], SamplingParams(**GREEDY))
    with pytest.raises(InvalidArgumentError, match="empty"):
        client.generate([[]], SamplingParams(**GREEDY))


def test_unknown_tag(client, still_serving):
    with pytest.raises(InvalidArgumentError, match="unknown memory tag 'gpu_cache'"):
        client.wake_up(["weights", "gpu_cache"])


def test_bad_sleep_level_and_mode(client, still_serving):
    with pytest.raises(InvalidArgumentError, match="level"):
        client.sleep(level=3)
    with pytest.raises(InvalidArgumentError, match="mode"):
        client.sleep(level=1, mode="nap")


def good_weights(client) -> dict[str, torch.Tensor]:
    """A manifest-valid tensor of the served model (embedding), for bad-update variants."""
    embedding = client.info()
    return {"model.embed_tokens.weight": torch.zeros(embedding.vocab_size, 64)}


@pytest.mark.parametrize("transport", ["stream", "shm"])
def test_refused_weight_updates_keep_the_old_weights(client, still_serving, transport):
    good = good_weights(client)
    cases = {
        "unknown parameter name": {**good, "model.layers.7.mlp.up_proj.weight": torch.zeros(2)},
        "has shape": {"model.embed_tokens.weight": torch.zeros(3, 3)},
        "has dtype": {"model.embed_tokens.weight": torch.zeros(512, 64, dtype=torch.float16)},
    }
    for words, weights in cases.items():
        with pytest.raises(InvalidArgumentError, match=words):
            client.update_weights(weights, transport=transport)


def test_raw_messages_the_client_never_sends(raw_stub, still_serving):
    def code_of(call, *args) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as info:
            list(call(*args, metadata=AUTH, timeout=30))  # all these calls stream replies
        assert info.value.details(), "a refusal must say what was wrong"
        return info.value.code()

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(raw_stub.Generate, pb.GenerateRequest()) == invalid  # no prompt
    assert code_of(raw_stub.GenerateBatch, pb.GenerateBatchRequest()) == invalid  # no prompts
    mismatched = pb.GenerateBatchRequest(
        prompts=[pb.Prompt(text="a"), pb.Prompt(text="b")],
        per_prompt_sampling_params=[pb.SamplingParams()],
    )
    assert code_of(raw_stub.GenerateBatch, mismatched) == invalid
    chunk_first = iter([pb.UpdateWeightsRequest(chunk=pb.StreamChunk(data=b"xx"))])
    assert code_of(raw_stub.UpdateWeights, chunk_first) == invalid
    bad_dtype = pb.WeightManifest(tensors=[pb.TensorMeta(name="x", shape=[1], dtype="float128")])
    assert code_of(raw_stub.UpdateWeights, iter([pb.UpdateWeightsRequest(manifest=bad_dtype)])
                   ) == invalid


def test_unset_sampling_fields_take_engine_defaults(raw_stub, llm, still_serving):
    request = pb.GenerateRequest(prompt=pb.Prompt(token_ids=pb.TokenIds(token_ids=PROMPT)))
    messages = list(raw_stub.Generate(request, metadata=AUTH, timeout=30))
    (final,) = [o for m in messages for o in m.outputs]
    assert len(final.token_ids) <= EngineSamplingParams().max_tokens
    assert final.finish_reason in ("stop", "length")


def test_update_while_generating_is_refused(client, still_serving):
    # So that no completion mixes two weight versions; nothing changes.
    stream = client.generate_stream(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
    next(stream)
    try:
        with pytest.raises(FailedPreconditionError, match="still generating"):
            client.update_weights(good_weights(client), transport="stream")
    finally:
        stream.close()
