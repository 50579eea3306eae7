"""The receiving side of CUDA IPC: a buffer another process shares on the same GPU, mapped
here (weight updates over `cuda_ipc`, and KV transfers over it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_engine.protocol import WeightUpdateError


@dataclass(frozen=True)
class CudaIpcHandle:
    """What a CUDA IPC handle carries: the fields of the wire's CudaIpcHandle, with its
    defaults (a wire message works wherever this is asked for)."""

    device: int = 0
    handle: bytes = b""
    storage_size_bytes: int = 0
    storage_offset_bytes: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False
    buffer_offset_bytes: int = 0
    """Byte offset of the buffer inside the storage."""
    buffer_num_bytes: int = 0
    device_uuid: str = ""
    """The GPU's UUID: ordinals differ between processes; `device` is only the fallback."""


def local_cuda_ordinal(device_uuid: str, fallback_ordinal: int, uuids: list[str]) -> int:
    """This process's ordinal of the GPU named by `device_uuid` (`uuids[i]` is GPU i's)."""
    if not device_uuid:
        return fallback_ordinal
    if device_uuid not in uuids:
        raise WeightUpdateError(
            f"the client's GPU {device_uuid} is not visible to the server (it sees "
            f"{uuids or 'no GPU'}); cuda_ipc needs both on one GPU: use transport='shm'"
        )
    return uuids.index(device_uuid)


def open_cuda_ipc_buffer(handle: CudaIpcHandle) -> torch.Tensor:
    """Map a CUDA buffer of another process (same GPU) as a 1-D uint8 tensor."""
    if not torch.cuda.is_available():
        raise WeightUpdateError("the cuda_ipc transport needs CUDA on the server")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuids = [str(torch.cuda.get_device_properties(i).uuid)
             for i in range(torch.cuda.device_count())]
    device = local_cuda_ordinal(handle.device_uuid, handle.device, uuids)
    return rebuild_cuda_tensor(
        torch.Tensor, (handle.buffer_num_bytes,), (1,), handle.buffer_offset_bytes,
        torch.storage.TypedStorage, torch.uint8, device, handle.handle,
        handle.storage_size_bytes, handle.storage_offset_bytes, False,
        handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle or None,
        handle.event_sync_required,
    )
