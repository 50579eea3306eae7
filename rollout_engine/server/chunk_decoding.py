"""Hand decoding of UpdateWeights stream chunks, so that their bytes are never copied twice."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from protos import rollout_pb2 as pb

# The views of received bytes are only read (copied into the parameters), never written.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


@dataclass
class RawChunk:
    """A StreamChunk whose data stays a view of the received message (no copies)."""

    pieces: list[pb.TensorPiece]
    data: memoryview


def decode_update_request(raw: bytes) -> pb.UpdateWeightsRequest | RawChunk:
    """UpdateWeights' request deserializer: chunks are decoded by hand so that their data is
    not copied twice more by protobuf; every other message goes through protobuf."""
    if raw[:1] == b"\x12":  # field 2 (chunk), length-delimited
        try:
            length, start = _read_varint(raw, 1)
            if start + length == len(raw):
                chunk = _decode_stream_chunk(memoryview(raw), start)
                if chunk is not None:
                    return chunk
        except ValueError:
            pass  # malformed: protobuf raises the decode error
    return pb.UpdateWeightsRequest.FromString(raw)


def _decode_stream_chunk(view: memoryview, pos: int) -> RawChunk | None:
    pieces, data = [], memoryview(b"")
    while pos < len(view):
        tag, pos = _read_varint(view, pos)
        if tag & 7 != 2:
            return None  # not a length-delimited field: let protobuf handle (or refuse) it
        length, pos = _read_varint(view, pos)
        if pos + length > len(view):
            raise ValueError("truncated field")
        field = view[pos : pos + length]
        if tag >> 3 == 1:
            pieces.append(pb.TensorPiece.FromString(field))
        elif tag >> 3 == 2:
            data = field
        pos += length
    return RawChunk(pieces, data)


def _read_varint(buffer: bytes | memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buffer) or shift > 63:
            raise ValueError("truncated varint")
        byte = buffer[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def stream_chunk_buffer(chunk: RawChunk | pb.StreamChunk) -> torch.Tensor:
    """A uint8 view of a chunk's bytes (the view keeps the received message alive)."""
    data = chunk.data  # with protobuf, each access copies: read it once
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)
