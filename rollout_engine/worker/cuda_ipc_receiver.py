"""The receiving side of CUDA IPC: a buffer another process shares on the same GPU, mapped
here (weight updates over `cuda_ipc`, and KV transfers over it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rollout_engine.protocol import WeightUpdateError

if TYPE_CHECKING:
    from protos import rollout_pb2 as pb


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


def open_cuda_ipc_buffer(handle: pb.CudaIpcHandle) -> torch.Tensor:
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
