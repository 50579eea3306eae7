"""Weight transports: named tensors packed into buckets and sent as stream chunks, /dev/shm
segments or CUDA IPC buffers, with the server acknowledging each shared bucket.

An update is a `WeightManifest` (names, shapes, dtypes, in order) and a source of tensors in
that order, read once. The source may be a list, or an iterator that makes each tensor only
when asked for it (a trainer gathering sharded parameters, or merging LoRA adapters while it
iterates): each tensor is copied into a bucket as it is yielded, and the iterator is
advanced only once the tensor's bytes are in a bucket. Beyond the tensor being read, an
update holds only its buckets.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import uuid
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from memory.cuda_ipc import cuda_ipc_descriptor
from memory.shm import SHM_DIR, unlink_all
from protos import rollout_pb2 as pb
from protos.weight_codec import copy_bytes, dtype_name, encode_stream_chunk
from rollout_engine.protocol import WeightUpdateError

TransportName = Literal["stream", "shm", "cuda_ipc"]
TRANSPORTS: dict[str, int] = {
    "stream": pb.TRANSPORT_STREAM,
    "shm": pb.TRANSPORT_SHM,
    "cuda_ipc": pb.TRANSPORT_CUDA_IPC,
}
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


def for_several_readers(weights, manifest) -> list:
    """`weights` in a form that several engines can each read in turn (a pool, a prefill and a
    decode engine): (name, tensor) pairs without a manifest; with one, its items held in a
    list (a generator is read here, once)."""
    if manifest is None:
        return named_tensors(weights)
    return weights if isinstance(weights, list) else list(weights)


@dataclass(frozen=True)
class TensorMeta:
    """Name, shape and dtype of one tensor of an update."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class WeightManifest:
    """What an update sends, in order, and the device its tensors come from."""

    tensors: tuple[TensorMeta, ...]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    lora: pb.LoRATarget | None = None
    """Set: the tensors are a LoRA adapter to load under this target, not model weights."""

    @classmethod
    def of(cls, tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightManifest:
        """The manifest of (name, tensor) pairs, read in one pass without keeping them (an
        iterator that makes each tensor when asked for it works too)."""
        entries, device = [], torch.device("cpu")
        for name, tensor in tensors:
            entries.append(TensorMeta(name, tuple(tensor.shape), tensor.dtype))
            if tensor.is_cuda:
                device = tensor.device
        return cls(tuple(entries), device)

    def cast(self, dtype: torch.dtype | None) -> WeightManifest:
        """The manifest of the same tensors sent as `dtype` (None: unchanged)."""
        if dtype is None:
            return self
        return WeightManifest(
            tuple(TensorMeta(m.name, m.shape, dtype) for m in self.tensors), self.device,
            self.lora,
        )

    @property
    def num_bytes(self) -> int:
        return sum(m.num_bytes for m in self.tensors)


def manifest_request(manifest: WeightManifest, transport: TransportName) -> pb.UpdateWeightsRequest:
    message = pb.WeightManifest(transport=TRANSPORTS[transport])
    for meta in manifest.tensors:
        message.tensors.add(
            name=meta.name, shape=list(meta.shape), dtype=dtype_name(meta.dtype)
        )
    if manifest.lora is not None:
        message.lora.CopyFrom(manifest.lora)
    return pb.UpdateWeightsRequest(manifest=message)


@dataclass
class Piece:
    """`num_bytes` bytes of tensor `index`, from byte `tensor_offset`, at `buffer_offset`."""

    index: int
    tensor_offset: int
    num_bytes: int
    buffer_offset: int


def plan_buckets(manifest: WeightManifest, bucket_bytes: int) -> list[list[Piece]]:
    """Pack tensors in order into buckets of at most `bucket_bytes`. A tensor that fits in a
    bucket is never split (the server then writes it straight from the bucket); only tensors
    larger than a bucket span several."""
    if bucket_bytes < ALIGNMENT_BYTES:
        raise ValueError(f"bucket_bytes must be >= {ALIGNMENT_BYTES}, got {bucket_bytes}")
    buckets: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for index, meta in enumerate(manifest.tensors):
        num_bytes, offset = meta.num_bytes, 0
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


class ManifestMismatchError(WeightUpdateError):
    """The tensors a source yields differ from the update's manifest (checked by the sender,
    before the bytes leave): the update is abandoned without a commit."""


class TensorReader:
    """The update's tensors as 1-D byte views, read from `source` in manifest order with one
    tensor alive at a time (cast to `dtype` first when given, then moved to `device`).

    Each tensor is checked against its manifest entry as it arrives; `finish` checks that the
    source ends with the manifest, and `close` ends the source early (running an iterator's
    clean-up, e.g. unmerging adapters) when the update stops halfway.
    """

    def __init__(
        self,
        source: Iterable[tuple[str, torch.Tensor]],
        manifest: WeightManifest,
        device: torch.device | None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.is_stable = isinstance(source, list | tuple)
        """Tensors of a list stay valid after the reader moves on; an iterator's may not
        (a gather scope closes, an adapter is unmerged), so their bytes are copied out."""
        self._source = iter(source)
        self._manifest, self._device, self._dtype = manifest, device, dtype
        self._index, self._view = -1, torch.empty(0, dtype=torch.uint8)

    def slice(self, piece: Piece) -> torch.Tensor:
        while self._index < piece.index:
            self._advance()
        return self._view[piece.tensor_offset : piece.tensor_offset + piece.num_bytes]

    def finish(self) -> None:
        """Read the rest (tensors of no bytes have no pieces) and check nothing follows."""
        while self._index < len(self._manifest.tensors) - 1:
            self._advance()
        self._view = torch.empty(0, dtype=torch.uint8)
        extra = next(self._source, None)
        if extra is not None:
            self.close()
            raise ManifestMismatchError(
                f"the weights yielded {extra[0]!r} after the {len(self._manifest.tensors)} "
                "tensors of the manifest"
            )

    def close(self) -> None:
        self._view = torch.empty(0, dtype=torch.uint8)
        close = getattr(self._source, "close", None)
        if close is not None:
            close()

    def _advance(self) -> None:
        index = self._index + 1
        meta = self._manifest.tensors[index]
        item = next(self._source, None)
        if item is None:
            raise ManifestMismatchError(
                f"the weights ended after {index} of the manifest's "
                f"{len(self._manifest.tensors)} tensors (next expected: {meta.name!r})"
            )
        name, tensor = item
        if self._dtype is not None and tensor.dtype != self._dtype:
            tensor = tensor.to(self._dtype)
        if name != meta.name or tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
            raise ManifestMismatchError(
                f"tensor {index} of the weights is {name!r} {tuple(tensor.shape)} {tensor.dtype}"
                f" but the manifest says {meta.name!r} {meta.shape} {meta.dtype}"
            )
        if self._device is not None:
            tensor = tensor.to(self._device)
        self._index = index
        self._view = tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _pieces_proto(manifest: WeightManifest, pieces: list[Piece]) -> list[pb.TensorPiece]:
    return [
        pb.TensorPiece(name=manifest.tensors[p.index].name, tensor_offset=p.tensor_offset,
                       num_bytes=p.num_bytes, buffer_offset=p.buffer_offset)
        for p in pieces
    ]


# --------------------------------------------------------------------------------- senders


def stream_requests(
    manifest: WeightManifest, reader: TensorReader, chunk_bytes: int, acks: Acks
) -> Iterator[pb.UpdateWeightsRequest | bytes]:
    """Manifest, then the bytes inside the messages (pre-serialized), then a commit."""
    try:
        yield manifest_request(manifest, "stream")
        if not acks.wait_accepted():
            return
        for pieces in plan_buckets(manifest, chunk_bytes):
            parts: list[bytes | memoryview] = []
            end = 0
            for i, piece in enumerate(pieces):
                if i and piece.index != pieces[i - 1].index and not reader.is_stable:
                    # The source moves on: an iterator's earlier tensor may not outlive that.
                    parts = [bytes(p) if isinstance(p, memoryview) else p for p in parts]
                if piece.buffer_offset > end:
                    parts.append(bytes(piece.buffer_offset - end))  # alignment padding
                parts.append(reader.slice(piece).numpy().data)
                end = piece.buffer_offset + piece.num_bytes
            yield encode_stream_chunk(_pieces_proto(manifest, pieces), parts, end)
            if acks.is_stopped:
                return
        reader.finish()
        yield pb.UpdateWeightsRequest(commit=pb.CommitWeights())
    finally:
        reader.close()


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
        self._finalizer = weakref.finalize(self, unlink_all, self._paths)
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
            self._descriptors = [cuda_ipc_descriptor(b) for b in self.buffers]

    def _add_cuda_slot(self, device: torch.device) -> None:
        self.buffers.append(torch.empty(self.slot_bytes, dtype=torch.uint8, device=device))


def shared_requests(
    manifest: WeightManifest, reader: TensorReader, slots: SharedSlots, acks: Acks
) -> Iterator[pb.UpdateWeightsRequest]:
    """Manifest, then descriptors of filled slots (each reused once acknowledged), then commit."""
    try:
        yield manifest_request(manifest, slots.kind)
        if not acks.wait_accepted():
            return
        slots.begin_update()
        for bucket_id, pieces in enumerate(plan_buckets(manifest, slots.slot_bytes)):
            num_slots = slots.num_slots
            if bucket_id >= num_slots and not acks.wait_done(bucket_id - num_slots):
                return
            slot = bucket_id % num_slots
            buffer = slots.buffers[slot]
            for piece in pieces:
                target = buffer[piece.buffer_offset : piece.buffer_offset + piece.num_bytes]
                copy_bytes(target, reader.slice(piece))
            if slots.kind == "cuda_ipc":
                torch.cuda.current_stream(buffer.device).synchronize()
            bucket = pb.SharedBucket(bucket_id=bucket_id, pieces=_pieces_proto(manifest, pieces))
            slots.describe(slot, bucket)
            yield pb.UpdateWeightsRequest(bucket=bucket)
        reader.finish()
        yield pb.UpdateWeightsRequest(commit=pb.CommitWeights())
    finally:
        reader.close()


def guarded(requests: Iterator[pb.UpdateWeightsRequest], acks: Acks):
    """Run on gRPC's sending thread: an exception ends the stream without a commit and is
    kept for the caller, instead of being swallowed by gRPC."""
    try:
        yield from requests
    except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
        acks.error = exc
