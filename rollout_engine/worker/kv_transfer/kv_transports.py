"""How KV bytes travel between engines: a /dev/shm file or a CUDA IPC handle on one host, a
gRPC stream pulled from the prefill server anywhere (its serving half is
`rollout_engine/server/pull_kv.py`)."""

from __future__ import annotations

import base64
import json
import os
import re
import threading
import time
import uuid

import torch

from memory.shm import SHM_DIR, unlink_all
from rollout_engine.protocol import DEFAULT_MAX_MESSAGE_BYTES, KVTransferParams

_SHM_NAME = re.compile(r"^rollout-kv-[A-Za-z0-9_\-]{1,100}$")


class KVTransferFailed(RuntimeError):
    """A transfer could not complete: the peer is gone, the handle expired, the data is
    malformed. The request is recomputed, never failed, because of it."""


# ---------------------------------------------------------------------- transports: shm


def write_shm(kv: torch.Tensor) -> str:
    """Write `kv`'s bytes to a new /dev/shm file; its name."""
    name = f"rollout-kv-{os.getpid()}-{uuid.uuid4().hex[:16]}"
    path = os.path.join(SHM_DIR, name)
    data = kv.detach().cpu().contiguous().view(torch.uint8).numpy()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(memoryview(data))
    except BaseException:
        unlink_all([path])
        raise
    return name


def fetch_shm(params: KVTransferParams, deadline: float) -> torch.Tensor:
    """Read and unlink a handle's /dev/shm file: the KV's raw bytes (1-D uint8)."""
    if not _SHM_NAME.match(params.location):
        raise KVTransferFailed(f"not a KV shared-memory name: {params.location!r}")
    path = os.path.join(SHM_DIR, params.location)
    try:
        with open(path, "rb") as file:
            data = bytearray(file.read())
    except FileNotFoundError:
        raise KVTransferFailed(
            f"{path} does not exist: the handle expired or was used, or the prefill engine "
            "runs on another host (use kv_transport='grpc')"
        ) from None
    unlink_all([path])
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


# ----------------------------------------------------------------- transports: cuda_ipc


def cuda_ipc_location(kv: torch.Tensor) -> str:
    """The IPC handle of a CUDA tensor's storage, as JSON (bytes in base64)."""
    from memory.cuda_ipc import cuda_ipc_descriptor

    descriptor = cuda_ipc_descriptor(kv.view(-1).view(torch.uint8))
    return json.dumps({
        k: base64.b64encode(v).decode() if isinstance(v, bytes) else v
        for k, v in descriptor.items()
    })


def cuda_ipc_descriptor_of(params: KVTransferParams) -> dict:
    """The CudaIpcHandle fields a handle's `location` carries (bytes decoded)."""
    try:
        fields = json.loads(params.location)
    except json.JSONDecodeError as exc:
        raise KVTransferFailed(f"not a CUDA IPC handle: {exc}") from None
    for key in ("handle", "ref_counter_handle", "event_handle"):
        fields[key] = base64.b64decode(fields.get(key, ""))
    return fields


# --------------------------------------------------------------------- transports: grpc


class GrpcFetcher:
    """Decode side of the "grpc" transport: pulls a handle's KV from the prefill server it
    names. One channel per address, reused."""

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._max_message_bytes = max_message_bytes
        self._channels: dict = {}  # address -> grpc.Channel
        self._lock = threading.Lock()

    def __call__(self, params: KVTransferParams, deadline: float) -> torch.Tensor:
        import grpc

        from protos import rollout_pb2 as pb
        from protos import rollout_pb2_grpc as pb_grpc

        stub = pb_grpc.RolloutEngineStub(self._channel(params.location))
        timeout = max(deadline - time.monotonic(), 0.001)
        try:
            responses = stub.PullKV(pb.PullKVRequest(transfer_id=params.transfer_id),
                                    timeout=timeout)
            header = next(responses)
            data = bytearray()
            for message in responses:
                data += message.data
        except grpc.RpcError as exc:
            raise KVTransferFailed(
                f"pulling KV from {params.location} failed: {exc.code().name}: {exc.details()}"
            ) from None
        except StopIteration:
            raise KVTransferFailed(f"{params.location} sent no KV") from None
        dtype = getattr(torch, header.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise KVTransferFailed(f"{params.location} sent KV of unknown dtype {header.dtype!r}")
        if not data:
            return torch.empty(0, dtype=dtype).view(tuple(header.shape))
        return torch.frombuffer(data, dtype=dtype).view(tuple(header.shape))

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def _channel(self, address: str):
        import grpc

        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = grpc.insecure_channel(address, options=[
                    ("grpc.max_receive_message_length", self._max_message_bytes),
                ])
            return channel


def fetch_cuda_ipc(params: KVTransferParams, deadline: float) -> torch.Tensor:
    """Decode side of the "cuda_ipc" transport: a private copy of the prefill engine's CUDA
    tensor (raw bytes), on this process's view of the same GPU."""
    from protos import rollout_pb2 as pb
    from rollout_engine.worker.cuda_ipc_receiver import open_cuda_ipc_buffer

    try:
        shared = open_cuda_ipc_buffer(pb.CudaIpcHandle(**cuda_ipc_descriptor_of(params)))
    except Exception as exc:
        raise KVTransferFailed(f"opening the CUDA IPC handle failed: {exc}") from exc
    copy = shared.clone()
    torch.cuda.current_stream(copy.device).synchronize()
    return copy
