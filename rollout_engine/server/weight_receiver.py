"""The receiving side of UpdateWeights: tensor bytes from messages, /dev/shm or CUDA IPC."""

from __future__ import annotations

import asyncio
import mmap
import os
import re
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

import torch

from memory.shm import SHM_DIR
from protos import rollout_pb2 as pb
from protos.weight_codec import RawChunk, copy_bytes, stream_chunk_buffer
from rollout_engine.protocol import InvalidRequestError, LoadedLoRA, WeightUpdateError
from rollout_engine.server.convert import (
    lora_target_from_proto,
    lora_to_proto,
    weight_manifest_from_proto,
)
from rollout_engine.server.status import check_decoded
from rollout_engine.worker.cuda_ipc_receiver import open_cuda_ipc_buffer

if TYPE_CHECKING:
    from rollout_engine.server.async_engine import AsyncEngine
    from rollout_engine.worker.weights.weight_update import ManifestEntry

_SHM_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")


class WeightUpdateReceiver:
    """One UpdateWeights call: manifest validated by the engine before any byte is written,
    then chunks or shared buckets written on the engine thread, then the commit."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def run(self, request_iterator) -> AsyncIterator[pb.UpdateWeightsResponse]:
        messages = request_iterator.__aiter__()
        first = check_decoded(await anext(messages, None))
        if not isinstance(first, pb.UpdateWeightsRequest) or first.WhichOneof("kind") != "manifest":
            raise InvalidRequestError("UpdateWeights must start with a manifest message")
        manifest = weight_manifest_from_proto(first.manifest)
        lora_target = lora_target_from_proto(first.manifest)
        if lora_target is None:
            update = await self.engine.begin_weight_update(manifest)
        else:
            update = await self.engine.begin_lora_push(manifest, *lora_target)
        self._update, self._assembler = update, TensorAssembler(manifest)
        self._buffers = SharedBuffers(self.engine.model.device)
        self._writing: asyncio.Future | None = None  # the previous chunk's write, overlapped
        committed = False
        try:
            yield pb.UpdateWeightsResponse(manifest_accepted=True)
            async for message in messages:
                reply = await self._handle(message)
                if reply is not None:
                    yield reply
                if reply is not None and reply.WhichOneof("kind") in ("weight_version",
                                                                      "lora_adapter"):
                    committed = True
                    return
            raise WeightUpdateError(
                "the update stream ended without a commit; the weights are inconsistent "
                "until a complete update lands"
            )
        finally:
            if self._writing is not None:  # the call ended early; nobody awaits this write
                self._writing.add_done_callback(_retrieve_exception)
            update.after_writes(self._buffers.close)
            if not committed:
                update.abort()

    async def _handle(self, message) -> pb.UpdateWeightsResponse | None:
        check_decoded(message)
        kind = "chunk" if isinstance(message, RawChunk) else message.WhichOneof("kind")
        if kind == "chunk":
            # Received while the previous chunk is still being written.
            chunk = message if isinstance(message, RawChunk) else message.chunk
            tensors = assemble(self._assembler, chunk.pieces, stream_chunk_buffer(chunk))
            await self._finish_writing()
            self._writing = self._update.write(tensors)
            return None
        await self._finish_writing()
        if kind == "bucket":
            buffer = self._buffers.get(message.bucket)
            await self._update.write(assemble(self._assembler, message.bucket.pieces, buffer))
            return pb.UpdateWeightsResponse(bucket_done=message.bucket.bucket_id)
        if kind == "commit":
            committed = await self._commit()
            if isinstance(committed, LoadedLoRA):
                return pb.UpdateWeightsResponse(lora_adapter=lora_to_proto(committed))
            return pb.UpdateWeightsResponse(weight_version=committed)
        raise WeightUpdateError(f"unexpected {kind!r} message after the manifest")

    async def _finish_writing(self) -> None:
        if self._writing is not None:
            writing, self._writing = self._writing, None
            await writing

    async def _commit(self) -> int | LoadedLoRA:
        incomplete = self._assembler.incomplete()
        if incomplete:
            raise WeightUpdateError(
                f"commit before all bytes arrived; incomplete tensors: {incomplete[:8]}"
            )
        await self._update.write(self._assembler.empty_tensors())
        return await self._update.finish()


class TensorAssembler:
    """Collects each manifest tensor from pieces that arrive in order; returns whole tensors."""

    def __init__(self, manifest: Sequence[ManifestEntry]) -> None:
        self._metas = {name: (shape, dtype) for name, shape, dtype in manifest}
        self._num_bytes = {
            name: _num_elements(shape) * _element_size(dtype) for name, shape, dtype in manifest
        }
        self._num_received = dict.fromkeys(self._num_bytes, 0)
        self._staging: dict[str, torch.Tensor] = {}

    def add(self, piece: pb.TensorPiece, buffer: torch.Tensor) -> torch.Tensor | None:
        """Take a piece out of `buffer` (1-D uint8); the whole tensor once it is complete."""
        name, start, num_bytes = piece.name, piece.tensor_offset, piece.num_bytes
        total = self._num_bytes.get(name)
        if total is None:
            raise WeightUpdateError(f"tensor {name!r} is not in the manifest")
        if start != self._num_received[name]:
            raise WeightUpdateError(
                f"piece of {name!r} starts at byte {start}, expected {self._num_received[name]}: "
                "send each tensor's bytes once, in order"
            )
        end = piece.buffer_offset + num_bytes
        in_tensor = 0 <= num_bytes and start + num_bytes <= total
        if not in_tensor or piece.buffer_offset < 0 or end > len(buffer):
            raise WeightUpdateError(
                f"piece of {name!r} (bytes {start}+{num_bytes} of {total}, buffer bytes "
                f"{piece.buffer_offset}..{end} of {len(buffer)}) is out of range"
            )
        data = buffer[piece.buffer_offset : end]  # [num_bytes] uint8
        self._num_received[name] = start + num_bytes
        if num_bytes == total:
            return self._as_tensor(name, data)
        staging = self._staging.get(name)
        if staging is None:
            staging = torch.empty(total, dtype=torch.uint8, device=data.device)
            self._staging[name] = staging
        copy_bytes(staging[start : start + num_bytes], data)
        if start + num_bytes < total:
            return None
        return self._as_tensor(name, self._staging.pop(name))

    def empty_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Tensors with no elements, which need no bytes."""
        return [
            (name, torch.empty(self._metas[name][0], dtype=self._metas[name][1]))
            for name, total in self._num_bytes.items()
            if total == 0 and self._num_received[name] == 0
        ]

    def incomplete(self) -> list[str]:
        return [n for n, total in self._num_bytes.items() if 0 < total != self._num_received[n]]

    def _as_tensor(self, name: str, data: torch.Tensor) -> torch.Tensor:
        shape, dtype = self._metas[name]
        if data.storage_offset() % _element_size(dtype):
            data = data.clone()  # an unaligned view cannot be reinterpreted
        return data.view(dtype).view(shape)


class SharedBuffers:
    """The shared buffers named in SharedBucket messages, opened once per update.

    CUDA buffers are cached by their whole location, not by the IPC handle alone: PyTorch
    gives every block of one caching-allocator segment the same handle, so two client slots
    in one segment differ only by their offsets and would otherwise alias each other.
    """

    def __init__(
        self,
        device: torch.device,
        open_ipc: Callable[[pb.CudaIpcHandle], torch.Tensor] | None = None,
    ) -> None:
        self._device = device
        self._open_ipc = open_ipc or open_cuda_ipc_buffer
        self._shm: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}
        self._cuda: dict[tuple, torch.Tensor] = {}

    def get(self, bucket: pb.SharedBucket) -> torch.Tensor:
        """The bucket's buffer as a 1-D uint8 tensor."""
        kind = bucket.WhichOneof("buffer")
        if kind == "shm_name":
            return self._shm_buffer(bucket.shm_name)
        if kind == "cuda_ipc":
            return self._cuda_buffer(bucket.cuda_ipc)
        raise WeightUpdateError("a shared bucket needs `shm_name` or `cuda_ipc`")

    def close(self) -> None:
        self._cuda.clear()
        for mapping, _ in self._shm.values():
            try:
                mapping.close()
            except BufferError:  # a view is still alive; the mapping goes with it
                pass
        self._shm.clear()

    def _shm_buffer(self, name: str) -> torch.Tensor:
        if name in self._shm:
            return self._shm[name][1]
        if not _SHM_NAME.match(name):
            raise WeightUpdateError(f"invalid shared memory name {name!r}")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise WeightUpdateError(
                f"shared memory {path} does not exist on the server's host; the shm transport "
                "needs client and server on one machine: use transport='stream'"
            ) from None
        try:
            # MAP_POPULATE maps every page now: far cheaper than one fault per page later.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, os.fstat(fd).st_size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)
        self._shm[name] = (mapping, buffer)
        return buffer

    def _cuda_buffer(self, handle: pb.CudaIpcHandle) -> torch.Tensor:
        key = (handle.device_uuid, handle.device, handle.handle, handle.storage_offset_bytes,
               handle.buffer_offset_bytes, handle.buffer_num_bytes)
        buffer = self._cuda.get(key)
        if buffer is None:
            buffer = self._cuda[key] = self._open_ipc(handle)
        return buffer


def assemble(
    assembler: TensorAssembler, pieces, buffer: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """The tensors these pieces complete."""
    tensors = []
    for piece in pieces:
        tensor = assembler.add(piece, buffer)
        if tensor is not None:
            tensors.append((piece.name, tensor))
    return tensors


def _retrieve_exception(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _num_elements(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
