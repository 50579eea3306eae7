"""Fuzz: random, mutated and garbage messages (and metadata) to every RPC, UpdateWeights chunks
included. The server never dies, answers every call with a status, and serves correctly after.

Seeded and bounded: a few hundred calls in `make test`, thousands in `make test-all`."""

from __future__ import annotations

import collections
import math
import random

import grpc
import pytest
from safetensors.torch import load_file

from protos import rollout_pb2 as pb
from protos.weight_codec import encode_stream_chunk
from rollout_engine.protocol import SERVICE_NAME
from tests.e2e.server_process import start_server
from tests.integration.hf_oracle import hf_greedy_batch
from trainer_bridge import EngineClient, SamplingParams

CALL_TIMEOUT_S = 30.0
# A status is an answer; what must never happen is a dead server, a hang or an unhandled error.
ALLOWED_CODES = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
INTERESTING_INTS = [0, 1, 2, 3, -1, -(2**31), 2**31 - 1, 2**63 - 1, 7, 100, 511, 512, 10**6]
INTERESTING_FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-9, 1e9, math.inf, -math.inf, math.nan, 2.0]
UNARY = {
    "Sleep": pb.SleepRequest, "WakeUp": pb.WakeUpRequest,
    "ReleaseKVCache": pb.ReleaseKVCacheRequest, "ResetPrefixCache": pb.ResetPrefixCacheRequest,
    "GetInfo": pb.GetInfoRequest, "GetMemoryState": pb.GetMemoryStateRequest,
}
STREAMING = {"Generate": pb.GenerateRequest, "GenerateBatch": pb.GenerateBatchRequest}
NUM_CALLS = 300


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, llama_dir):
    process = start_server(tmp_path_factory, llama_dir, "--max-model-len", "64",
                           "--max-inflight-requests", "64", "--max-n", "8")
    yield process
    assert process.stop() == 0, process.log()[-3000:]


# ----------------------------------------------------------------------------- messages


def random_value(rng: random.Random, field):
    """A random value of one scalar field of `field`'s type."""
    kind = field.cpp_type
    if kind == field.CPPTYPE_BOOL:
        return rng.random() < 0.5
    if kind in (field.CPPTYPE_FLOAT, field.CPPTYPE_DOUBLE):
        return rng.choice(INTERESTING_FLOATS + [rng.uniform(-5, 5)])
    if kind == field.CPPTYPE_STRING:
        if field.type == field.TYPE_BYTES:
            return rng.randbytes(rng.randint(0, 64))
        return rng.choice(["", "abort", "wait", "weights", "kv_cache", "x" * rng.randint(1, 300),
                           "model.norm.weight", "float32", "\u00e9\u4e2d", "bfloat16"])
    if kind == field.CPPTYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values])
    value = rng.choice(INTERESTING_INTS + [rng.randint(-50, 600)])
    if kind in (field.CPPTYPE_UINT32, field.CPPTYPE_UINT64):
        value = abs(value)
    bits = 32 if kind in (field.CPPTYPE_INT32, field.CPPTYPE_UINT32) else 64
    if kind in (field.CPPTYPE_UINT32, field.CPPTYPE_UINT64):
        return value % (2**bits)
    return max(min(value, 2 ** (bits - 1) - 1), -(2 ** (bits - 1)))


def random_message(rng: random.Random, message, depth: int = 0):
    """Fill some fields of `message` with random values, recursing into nested messages."""
    for field in message.DESCRIPTOR.fields:
        if rng.random() < 0.4:
            continue
        if field.containing_oneof is not None and rng.random() < 0.5:
            continue
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry or depth > 3:
                continue
            if field.is_repeated:
                for _ in range(rng.randint(0, 3)):
                    random_message(rng, getattr(message, field.name).add(), depth + 1)
            else:
                random_message(rng, getattr(message, field.name), depth + 1)
        elif field.is_repeated:
            getattr(message, field.name).extend(
                random_value(rng, field) for _ in range(rng.randint(0, 20)))
        else:
            setattr(message, field.name, random_value(rng, field))
    return message


def mutate(rng: random.Random, raw: bytes) -> bytes:
    """1-5 byte-level mutations: flips, insertions, deletions, truncation, duplication."""
    data = bytearray(raw)
    for _ in range(rng.randint(1, 5)):
        op = rng.randrange(5)
        pos = rng.randint(0, len(data))
        if op == 0 and data:
            data[min(pos, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            data[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 2:
            del data[pos : pos + rng.randint(1, 8)]
        elif op == 3:
            del data[pos:]
        else:
            data += data[pos : pos + rng.randint(1, 16)]
    return bytes(data)


def request_bytes(rng: random.Random, message_cls) -> bytes:
    """A random message, a mutated one, or garbage."""
    choice = rng.random()
    if choice < 0.1:
        return rng.randbytes(rng.randint(0, 200))
    raw = random_message(rng, message_cls()).SerializeToString()
    return mutate(rng, raw) if choice < 0.5 else raw


def update_stream(rng: random.Random) -> list[bytes]:
    """A random sequence of UpdateWeights messages: manifests, chunks, buckets, commits."""
    messages = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.randrange(4)
        if kind == 0:
            manifest = pb.WeightManifest(transport=pb.TRANSPORT_STREAM)
            manifest.tensors.add(name=rng.choice(["model.norm.weight", "nope"]),
                                 shape=[rng.choice([64, 3, -1, 2**40])],
                                 dtype=rng.choice(["float32", "float16", "wat"]))
            raw = pb.UpdateWeightsRequest(manifest=manifest).SerializeToString()
        elif kind == 1:
            piece = pb.TensorPiece(name="model.norm.weight", tensor_offset=rng.choice([0, 4, -8]),
                                   num_bytes=rng.choice([0, 4, 256, 2**40]),
                                   buffer_offset=rng.choice([0, 3, -1, 1000]))
            data = rng.randbytes(rng.choice([0, 4, 256]))
            raw = encode_stream_chunk([piece], [data], len(data))
        elif kind == 2:
            raw = random_message(rng, pb.UpdateWeightsRequest()).SerializeToString()
        else:
            raw = pb.UpdateWeightsRequest(commit=pb.CommitWeights()).SerializeToString()
        messages.append(mutate(rng, raw) if rng.random() < 0.3 else raw)
    return messages


def random_metadata(rng: random.Random) -> tuple[tuple[str, str], ...]:
    keys = ["authorization", "x-fuzz", "grpc-timeout-ish", "rollout-error-type"]
    return tuple((rng.choice(keys), rng.choice(["", "Bearer x", "\u00e9" * 3, "1" * 100]).encode(
        "ascii", "ignore").decode()) for _ in range(rng.randint(0, 3)))


# --------------------------------------------------------------------------------- calls


def call_once(channel: grpc.Channel, rng: random.Random) -> grpc.StatusCode:
    """One fuzzed call; its status code."""
    method = rng.choice([*UNARY, *STREAMING, "UpdateWeights"])
    path = f"/{SERVICE_NAME}/{method}"
    identity = {"request_serializer": lambda raw: raw, "response_deserializer": lambda raw: raw}
    metadata = random_metadata(rng) if rng.random() < 0.2 else None
    try:
        if method in UNARY:
            channel.unary_unary(path, **identity)(
                request_bytes(rng, UNARY[method]), timeout=CALL_TIMEOUT_S, metadata=metadata)
        elif method in STREAMING:
            list(channel.unary_stream(path, **identity)(
                request_bytes(rng, STREAMING[method]), timeout=CALL_TIMEOUT_S, metadata=metadata))
        else:
            list(channel.stream_stream(path, **identity)(
                iter(update_stream(rng)), timeout=CALL_TIMEOUT_S, metadata=metadata))
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def run_fuzz(server, llama_dir, num_calls: int, seed: int) -> collections.Counter:
    rng = random.Random(seed)
    codes: collections.Counter = collections.Counter()
    with grpc.insecure_channel(server.address) as channel:
        for i in range(num_calls):
            code = call_once(channel, rng)
            codes[code.name] += 1
            assert code in ALLOWED_CODES, f"call {i}: {code}\n{server.log()[-3000:]}"
            assert server.process.poll() is None, f"the server died at call {i}"
    return codes


@pytest.mark.parametrize(
    "num_calls", [NUM_CALLS, pytest.param(3000, marks=pytest.mark.slow)], ids=["short", "long"]
)
def test_fuzzed_calls_get_statuses_and_the_server_serves_after(fuzz_server, llama_dir,
                                                               num_calls):
    codes = run_fuzz(fuzz_server, llama_dir, num_calls, seed=num_calls)
    print(f"\nfuzz: {num_calls} calls, statuses {dict(codes)}")
    prompts = [[5 + i, 17, 99, 250, 7, 31] for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with EngineClient(fuzz_server.address, timeout=60) as client:
        client.wake_up()
        client.update_weights(load_file(str(llama_dir / "model.safetensors")), transport="stream")
        outputs = client.generate(prompts, greedy)
        assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_batch(str(llama_dir),
                                                                            prompts, 8)
        info = client.info()
        assert info.num_inflight_requests == 0 and info.num_free_blocks == info.num_blocks
