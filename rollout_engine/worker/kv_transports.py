"""How KV bytes travel between engines on one host: a /dev/shm file, or a CUDA IPC handle
(the gRPC stream lives with the server, `rollout_engine/server/kv_transfer.py`)."""

from __future__ import annotations

import base64
import json
import os
import re
import uuid

import torch

from memory.shm import SHM_DIR, unlink_all
from rollout_engine.protocol import KVTransferParams

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
