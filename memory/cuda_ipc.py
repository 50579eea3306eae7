"""Share a CUDA buffer with another process on the same GPU, by IPC handle."""

from __future__ import annotations

import torch


def cuda_ipc_descriptor(buffer: torch.Tensor) -> dict:
    """The CudaIpcHandle fields (protos/rollout.proto) of a 1-D uint8 CUDA buffer, from
    torch.multiprocessing's own reduction. The storage must stay alive while the other
    process may open it."""
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
