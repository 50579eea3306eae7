"""Weight transports: named tensors packed into buckets and sent as stream chunks, /dev/shm
segments or CUDA IPC buffers, with the server acknowledging each shared bucket."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import uuid
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from protos import rollout_pb2 as pb

TransportName = Literal["stream", "shm", "cuda_ipc"]
TRANSPORTS: dict[str, int] = {
    "stream": pb.TRANSPORT_STREAM,
    "shm": pb.TRANSPORT_SHM,
    "cuda_ipc": pb.TRANSPORT_CUDA_IPC,
}
SHM_DIR = "/dev/shm"
DEFAULT_BUCKET_BYTES = 16 * 1024 * 1024
# Bytes of one stream chunk at most: far below the default 64 MiB message limit.
DEFAULT_STREAM_CHUNK_BYTES = 8 * 1024 * 1024
ALIGNMENT_BYTES = 64
NUM_SLOTS = 2  # shared buffers in flight: the client fills one while the server copies one

NamedTensors = list[tuple[str, torch.Tensor]]


def named_tensors(weights: torch.nn.Module | Mapping[str, torch.Tensor] | Iterable) -> NamedTensors:
    """(name, tensor) pairs from a module (its state_dict), a mapping, or pairs."""
    if isinstance(weights, torch.nn.Module):
        items = weights.state_dict().items()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        items = weights
    pairs = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        pairs.append((str(name), tensor.detach()))
    return pairs


def manifest_request(tensors: NamedTensors, transport: TransportName) -> pb.UpdateWeightsRequest:
    manifest = pb.WeightManifest(transport=TRANSPORTS[transport])
    for name, tensor in tensors:
        manifest.tensors.add(
            name=name, shape=list(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch.")
        )
    return pb.UpdateWeightsRequest(manifest=manifest)


@dataclass
class Piece:
    """`num_bytes` bytes of tensor `index`, from byte `tensor_offset`, at `buffer_offset`."""

    index: int
    tensor_offset: int
    num_bytes: int
    buffer_offset: int


def plan_buckets(tensors: NamedTensors, bucket_bytes: int) -> list[list[Piece]]:
    """Pack tensors in order into buckets of at most `bucket_bytes`. A tensor that fits in a
    bucket is never split (the server then writes it straight from the bucket); only tensors
    larger than a bucket span several."""
    if bucket_bytes < ALIGNMENT_BYTES:
        raise ValueError(f"bucket_bytes must be >= {ALIGNMENT_BYTES}, got {bucket_bytes}")
    buckets: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for index, (_, tensor) in enumerate(tensors):
        num_bytes, offset = tensor.numel() * tensor.element_size(), 0
        while offset < num_bytes:
            start = -(-used // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
            fits_whole = offset == 0 and num_bytes <= bucket_bytes
            overflows = start >= bucket_bytes or (fits_whole and start + num_bytes > bucket_bytes)
            if current and overflows:
                buckets.append(current)
                current, start = [], 0
            take = min(num_bytes - offset, bucket_bytes - start)
            current.append(Piece(index, offset, take, start))
            used, offset = start + take, offset + take
    if current:
        buckets.append(current)
    return buckets


class Acks:
    """Manifest and bucket acknowledgements, shared by the sending and receiving threads."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._is_accepted = False
        self._done: set[int] = set()
        self.is_stopped = False
        self.error: BaseException | None = None
        """An exception raised while packing; the update is abandoned (no commit)."""

    def accept(self) -> None:
        with self._cond:
            self._is_accepted = True
            self._cond.notify_all()

    def done(self, bucket_id: int) -> None:
        with self._cond:
            self._done.add(bucket_id)
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.is_stopped = True
            self._cond.notify_all()

    def wait_accepted(self) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._is_accepted or self.is_stopped)
            return not self.is_stopped

    def wait_done(self, bucket_id: int) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: bucket_id in self._done or self.is_stopped)
            return not self.is_stopped


class _ByteViews:
    """1-D uint8 views of the tensors, made when first needed (one tensor alive at a time)."""

    def __init__(self, tensors: NamedTensors, device: torch.device | None) -> None:
        self._tensors, self._device = tensors, device
        self._index, self._view = -1, torch.empty(0, dtype=torch.uint8)

    def slice(self, piece: Piece) -> torch.Tensor:
        if piece.index != self._index:
            tensor = self._tensors[piece.index][1]
            if self._device is not None:
                tensor = tensor.to(self._device)
            self._index = piece.index
            self._view = tensor.contiguous().reshape(-1).view(torch.uint8)
        return self._view[piece.tensor_offset : piece.tensor_offset + piece.num_bytes]


def copy_bytes(target: torch.Tensor, source: torch.Tensor) -> None:
    """`target[:] = source` for 1-D uint8 tensors. On CPU a plain memmove: torch's parallel
    copy is no faster for one buffer and stalls when the machine's cores are oversubscribed."""
    assert target.shape == source.shape and target.is_contiguous() and source.is_contiguous()
    if target.is_cpu and source.is_cpu:
        ctypes.memmove(target.data_ptr(), source.data_ptr(), source.numel())
    else:
        target.copy_(source, non_blocking=True)


def _pieces_proto(tensors: NamedTensors, pieces: list[Piece]) -> list[pb.TensorPiece]:
    return [
        pb.TensorPiece(name=tensors[p.index][0], tensor_offset=p.tensor_offset,
                       num_bytes=p.num_bytes, buffer_offset=p.buffer_offset)
        for p in pieces
    ]


# --------------------------------------------------------------------------------- senders


def stream_requests(
    tensors: NamedTensors, chunk_bytes: int, acks: Acks
) -> Iterator[pb.UpdateWeightsRequest | bytes]:
    """Manifest, then the bytes inside the messages (pre-serialized), then a commit."""
    yield manifest_request(tensors, "stream")
    if not acks.wait_accepted():
        return
    views = _ByteViews(tensors, torch.device("cpu"))
    for pieces in plan_buckets(tensors, chunk_bytes):
        parts, end = [], 0
        for piece in pieces:
            if piece.buffer_offset > end:
                parts.append(bytes(piece.buffer_offset - end))  # alignment padding
            parts.append(views.slice(piece).numpy().data)
            end = piece.buffer_offset + piece.num_bytes
        yield encode_stream_chunk(_pieces_proto(tensors, pieces), parts, end)
        if acks.is_stopped:
            return
    yield pb.UpdateWeightsRequest(commit=pb.CommitWeights())


def encode_stream_chunk(pieces: list[pb.TensorPiece], parts: list, num_data_bytes: int) -> bytes:
    """The wire bytes of `UpdateWeightsRequest(chunk=StreamChunk(pieces, data=b"".join(parts)))`,
    with one copy of the data instead of the three that building the message would take."""
    pieces_bytes = b"".join(
        b"\x0a" + _varint(p.ByteSize()) + p.SerializeToString() for p in pieces
    )  # StreamChunk.pieces: field 1, length-delimited
    data_header = b"\x12" + _varint(num_data_bytes)  # StreamChunk.data: field 2
    chunk_size = len(pieces_bytes) + len(data_header) + num_data_bytes
    header = b"\x12" + _varint(chunk_size)  # UpdateWeightsRequest.chunk: field 2
    return b"".join([header, pieces_bytes, data_header, *parts])


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def serialize_update_request(request: pb.UpdateWeightsRequest | bytes) -> bytes:
    """Request serializer of UpdateWeights that passes pre-serialized chunks through."""
    return request if isinstance(request, bytes) else request.SerializeToString()


class SharedSlots:
    """`num_slots` buffers the server reads from: /dev/shm files or CUDA tensors; reusable."""

    def __init__(
        self, kind: Literal["shm", "cuda_ipc"], slot_bytes: int, device=None,
        num_slots: int = NUM_SLOTS,
    ) -> None:
        self.kind, self.slot_bytes, self.num_slots = kind, slot_bytes, num_slots
        self.buffers: list[torch.Tensor] = []
        self._descriptors: list[dict] = []
        self._mmaps: list[mmap.mmap] = []
        self._paths: list[str] = []
        # Unlink the /dev/shm files even if close() is never called (at exit, at the latest).
        self._finalizer = weakref.finalize(self, _unlink_all, self._paths)
        for _ in range(num_slots):
            if kind == "shm":
                self._add_shm_slot()
            else:
                self._add_cuda_slot(device)

    def describe(self, slot: int, bucket: pb.SharedBucket) -> None:
        if self.kind == "shm":
            bucket.shm_name = self._descriptors[slot]["shm_name"]
        else:
            bucket.cuda_ipc.CopyFrom(pb.CudaIpcHandle(**self._descriptors[slot]))

    def close(self) -> None:
        self.buffers.clear()
        for mapping in self._mmaps:
            mapping.close()
        self._mmaps.clear()
        self._finalizer()

    def _add_shm_slot(self) -> None:
        name = f"rollout-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._paths.append(path)
        try:
            os.ftruncate(fd, self.slot_bytes)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, self.slot_bytes, flags=flags)
        finally:
            os.close(fd)
        self._mmaps.append(mapping)
        self.buffers.append(torch.frombuffer(mapping, dtype=torch.uint8))
        self._descriptors.append({"shm_name": name})

    def begin_update(self) -> None:
        """Share the CUDA buffers anew: each share carries one reference that the server's
        process releases when it lets go of the buffer at the end of the update."""
        if self.kind == "cuda_ipc":
            self._descriptors = [_cuda_ipc_descriptor(b) for b in self.buffers]

    def _add_cuda_slot(self, device: torch.device) -> None:
        self.buffers.append(torch.empty(self.slot_bytes, dtype=torch.uint8, device=device))


def _cuda_ipc_descriptor(buffer: torch.Tensor) -> dict:
    """CudaIpcHandle fields of a CUDA buffer, from torch.multiprocessing's own reduction."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    return {
        "device": args[6], "handle": args[7], "storage_size_bytes": args[8],
        "storage_offset_bytes": args[9], "ref_counter_handle": args[11],
        "ref_counter_offset": args[12], "event_handle": args[13] or b"",
        "event_sync_required": bool(args[14]), "buffer_offset_bytes": args[3],
        "buffer_num_bytes": buffer.numel(),
        "device_uuid": str(torch.cuda.get_device_properties(buffer.device).uuid),
    }


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    paths.clear()


def shared_requests(
    tensors: NamedTensors, slots: SharedSlots, acks: Acks
) -> Iterator[pb.UpdateWeightsRequest]:
    """Manifest, then descriptors of filled slots (each reused once acknowledged), then commit."""
    yield manifest_request(tensors, slots.kind)
    if not acks.wait_accepted():
        return
    slots.begin_update()
    is_cuda = slots.kind == "cuda_ipc"
    views = _ByteViews(tensors, None if is_cuda else torch.device("cpu"))
    for bucket_id, pieces in enumerate(plan_buckets(tensors, slots.slot_bytes)):
        num_slots = slots.num_slots
        if bucket_id >= num_slots and not acks.wait_done(bucket_id - num_slots):
            return
        slot = bucket_id % num_slots
        buffer = slots.buffers[slot]
        for piece in pieces:
            target = buffer[piece.buffer_offset : piece.buffer_offset + piece.num_bytes]
            copy_bytes(target, views.slice(piece))
        if is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()
        bucket = pb.SharedBucket(bucket_id=bucket_id, pieces=_pieces_proto(tensors, pieces))
        slots.describe(slot, bucket)
        yield pb.UpdateWeightsRequest(bucket=bucket)
    yield pb.UpdateWeightsRequest(commit=pb.CommitWeights())


def guarded(requests: Iterator[pb.UpdateWeightsRequest], acks: Acks):
    """Run on gRPC's sending thread: an exception ends the stream without a commit and is
    kept for the caller, instead of being swallowed by gRPC."""
    try:
        yield from requests
    except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
        acks.error = exc
