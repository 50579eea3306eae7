"""UpdateWeights' bytes as client and server write and read them: one codec for both sides."""

# Beside the schema: it writes rollout.proto's field numbers by hand, and it needs torch, which
# the torch-free `rollout_engine.protocol` may not import. trainer_bridge.transports (sending)
# and rollout_engine.server.weight_receiver (receiving) import it; tests/e2e/test_wire_format
# checks that each hand-encoded chunk is the protobuf message.

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass

import torch

from protos import rollout_pb2 as pb

# Views of received bytes are only read (copied into the parameters), never written.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64",
        "bool", "float8_e4m3fn", "float8_e5m2",
    )
    if hasattr(torch, name)
}
"""The dtypes a manifest may name, by their names on the wire."""

_CHUNK_TAG = b"\x12"
"""UpdateWeightsRequest.chunk and StreamChunk.data: field 2, length-delimited."""
_PIECE_TAG = b"\x0a"
"""StreamChunk.pieces: field 1, length-delimited."""


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name on the wire ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


@dataclass
class RawChunk:
    """A StreamChunk whose data stays a view of the received message (no copies)."""

    pieces: list[pb.TensorPiece]
    data: memoryview


# ---------------------------------------------------------------------------------- encoding


def encode_stream_chunk(pieces: list[pb.TensorPiece], parts: list, num_data_bytes: int) -> bytes:
    """The wire bytes of `UpdateWeightsRequest(chunk=StreamChunk(pieces, data=b"".join(parts)))`,
    with one copy of the data instead of the three that building the message would take."""
    pieces_bytes = b"".join(
        _PIECE_TAG + _varint(p.ByteSize()) + p.SerializeToString() for p in pieces
    )
    data_header = _CHUNK_TAG + _varint(num_data_bytes)
    chunk_size = len(pieces_bytes) + len(data_header) + num_data_bytes
    header = _CHUNK_TAG + _varint(chunk_size)
    return b"".join([header, pieces_bytes, data_header, *parts])


def serialize_update_request(request: pb.UpdateWeightsRequest | bytes) -> bytes:
    """UpdateWeights' request serializer: pre-serialized chunks pass through."""
    return request if isinstance(request, bytes) else request.SerializeToString()


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# ---------------------------------------------------------------------------------- decoding


def decode_update_request(raw: bytes) -> pb.UpdateWeightsRequest | RawChunk:
    """UpdateWeights' request deserializer: chunks are decoded by hand so that their data is
    not copied twice more by protobuf; every other message goes through protobuf."""
    if raw[:1] == _CHUNK_TAG:
        try:
            length, start = _read_varint(raw, 1)
            if start + length == len(raw):
                chunk = _decode_stream_chunk(memoryview(raw), start)
                if chunk is not None:
                    return chunk
        except ValueError:
            pass  # malformed: protobuf raises the decode error
    return pb.UpdateWeightsRequest.FromString(raw)


def stream_chunk_buffer(chunk: RawChunk | pb.StreamChunk) -> torch.Tensor:
    """A uint8 view of a chunk's bytes (the view keeps the received message alive)."""
    data = chunk.data  # with protobuf, each access copies: read it once
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)


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


# ------------------------------------------------------------------------------------ copying


def copy_bytes(target: torch.Tensor, source: torch.Tensor) -> None:
    """`target[:] = source` for 1-D uint8 tensors on one device (a bucket filled by the client,
    a tensor staged by the server). On CPU a plain memmove: torch's parallel copy is no faster
    for one buffer and stalls when the machine's cores are oversubscribed. On CUDA the copy is
    queued on the current stream; each side synchronizes before the bytes change hands."""
    assert target.shape == source.shape and target.is_contiguous() and source.is_contiguous()
    if target.is_cpu and source.is_cpu:
        ctypes.memmove(target.data_ptr(), source.data_ptr(), source.numel())
    else:
        target.copy_(source, non_blocking=True)
