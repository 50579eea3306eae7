"""The hand-encoded and hand-decoded stream chunks are exactly the protobuf messages."""

from __future__ import annotations

import pytest
import torch

from protos import rollout_pb2 as pb
from protos.weight_codec import RawChunk, decode_update_request, encode_stream_chunk
from trainer_bridge.transports import (
    ALIGNMENT_BYTES,
    Acks,
    TensorReader,
    WeightManifest,
    plan_buckets,
    stream_requests,
)


def test_encoded_chunk_parses_as_the_protobuf_message():
    pieces = [pb.TensorPiece(name="a.weight", tensor_offset=0, num_bytes=300, buffer_offset=0),
              pb.TensorPiece(name="b" * 200, tensor_offset=7, num_bytes=5, buffer_offset=320)]
    parts = [bytes(range(256)) + bytes(44), bytes(20), b"hello"]
    raw = encode_stream_chunk(pieces, parts, 325)
    parsed = pb.UpdateWeightsRequest.FromString(raw)
    assert parsed == pb.UpdateWeightsRequest(chunk=pb.StreamChunk(pieces=pieces,
                                                                  data=b"".join(parts)))
    decoded = decode_update_request(raw)
    assert isinstance(decoded, RawChunk)
    assert list(decoded.pieces) == pieces and bytes(decoded.data) == b"".join(parts)


@pytest.mark.parametrize("message", [
    pb.UpdateWeightsRequest(commit=pb.CommitWeights()),
    pb.UpdateWeightsRequest(manifest=pb.WeightManifest(tensors=[pb.TensorMeta(name="x")])),
    pb.UpdateWeightsRequest(chunk=pb.StreamChunk(data=b"")),
    pb.UpdateWeightsRequest(),
])
def test_other_messages_go_through_protobuf(message):
    decoded = decode_update_request(message.SerializeToString())
    if isinstance(decoded, RawChunk):
        assert message.WhichOneof("kind") == "chunk" and not decoded.pieces
    else:
        assert decoded == message


def test_truncated_chunk_is_a_decode_error():
    raw = encode_stream_chunk([pb.TensorPiece(name="a", num_bytes=4)], [b"abcd"], 4)
    with pytest.raises(Exception, match="(?i)pars|decod|truncat"):
        decode_update_request(raw[:-2])


def test_buckets_split_only_tensors_larger_than_a_bucket():
    tensors = [("a", torch.zeros(100)), ("b", torch.zeros(60)), ("c", torch.zeros(500)),
               ("d", torch.zeros(3))]
    buckets = plan_buckets(WeightManifest.of(tensors), bucket_bytes=512)
    pieces = [(p.index, p.tensor_offset, p.num_bytes) for bucket in buckets for p in bucket]
    # "b" does not fit after "a": it starts a bucket instead of being split; "c" is larger than
    # a bucket, so it fills the rest of that bucket and spans the next ones.
    assert pieces == [(0, 0, 400), (1, 0, 240), (2, 0, 256), (2, 256, 512), (2, 768, 512),
                      (2, 1280, 512), (2, 1792, 208), (3, 0, 12)]
    for bucket in buckets:
        assert all(p.buffer_offset % ALIGNMENT_BYTES == 0 for p in bucket)
        assert all(p.buffer_offset + p.num_bytes <= 512 for p in bucket)
    assert len(buckets) == 6


def test_stream_requests_carry_every_byte_in_order():
    tensors = [("w", torch.arange(1000, dtype=torch.float32)), ("v", torch.ones(3, 5))]
    manifest = WeightManifest.of(tensors)
    acks = Acks()
    acks.accept()
    messages = [pb.UpdateWeightsRequest.FromString(m) if isinstance(m, bytes) else m
                for m in stream_requests(manifest, TensorReader(tensors, manifest, None), 1024, acks)]
    assert messages[0].WhichOneof("kind") == "manifest"
    assert messages[-1].WhichOneof("kind") == "commit"
    received = {name: bytearray() for name, _ in tensors}
    for message in messages[1:-1]:
        for piece in message.chunk.pieces:
            assert piece.tensor_offset == len(received[piece.name])
            data = message.chunk.data[piece.buffer_offset : piece.buffer_offset + piece.num_bytes]
            received[piece.name] += data
    for name, tensor in tensors:
        assert bytes(received[name]) == tensor.numpy().tobytes()
