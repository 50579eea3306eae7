"""What a CPU can check of the CUDA paths: which attention runs where, how CUDA-IPC buffers are
cached and matched to this process's GPU, and pinned-backup reuse across sleep cycles."""

from __future__ import annotations

import pytest
import torch

from kernels.dispatch import attention_backend
from protos import rollout_pb2 as pb
from rollout_engine.protocol import WeightUpdateError
from rollout_engine.server.weight_receiver import SharedBuffers
from rollout_engine.worker.cuda_ipc_receiver import local_cuda_ordinal


def test_attention_backend_per_device():
    assert attention_backend(torch.device("cuda", 1)) == "triton"
    assert attention_backend(torch.device("cpu")) == "cpu"
    # Triton off on CUDA: the reference, which builds every index on the tensors' device
    # (the CPU fast path plans on the host and cannot index CUDA tensors with it).
    assert attention_backend(torch.device("cuda"), use_triton=False) == "reference"
    assert attention_backend(torch.device("meta")) == "reference"


def ipc_handle(offset: int, uuid: str = "GPU-a") -> pb.CudaIpcHandle:
    return pb.CudaIpcHandle(device=0, handle=b"same-segment", storage_size_bytes=1 << 20,
                            storage_offset_bytes=offset, buffer_num_bytes=64, device_uuid=uuid)


def test_two_slots_of_one_allocator_segment_do_not_alias():
    """PyTorch gives every block of a caching-allocator segment the same IPC handle: the
    second slot must not be served the first one's buffer."""
    opened = []

    def open_ipc(handle: pb.CudaIpcHandle) -> torch.Tensor:
        opened.append(handle.storage_offset_bytes)
        return torch.full((handle.buffer_num_bytes,), len(opened), dtype=torch.uint8)

    buffers = SharedBuffers(torch.device("cpu"), open_ipc=open_ipc)
    first = buffers.get(pb.SharedBucket(cuda_ipc=ipc_handle(0)))
    second = buffers.get(pb.SharedBucket(cuda_ipc=ipc_handle(1 << 16)))
    assert int(first[0]) == 1 and int(second[0]) == 2
    assert buffers.get(pb.SharedBucket(cuda_ipc=ipc_handle(0))) is first  # still cached
    assert opened == [0, 1 << 16]


def test_ipc_buffers_are_matched_to_the_local_gpu_by_uuid():
    uuids = ["GPU-b", "GPU-a"]  # the server sees the client's GPU 0 as its GPU 1
    assert local_cuda_ordinal("GPU-a", 0, uuids) == 1
    assert local_cuda_ordinal("", 3, uuids) == 3  # an old client: its ordinal
    with pytest.raises(WeightUpdateError, match="not visible to the server"):
        local_cuda_ordinal("GPU-z", 0, uuids)


def test_kv_cache_is_sized_from_the_device_budget():
    from rollout_engine.worker.kv_cache_spec import plan_kv_cache_bytes

    GiB = 2**30
    # 140 GiB device, half of it ours: 70 - 1 (weights) - 2 (activations) = 67 GiB of KV.
    assert plan_kv_cache_bytes(140 * GiB, 130 * GiB, 1 * GiB, 2 * GiB, 0.5) == 67 * GiB
    # ... but never more than is free now (the trainer holds the rest).
    assert plan_kv_cache_bytes(140 * GiB, 20 * GiB, 1 * GiB, 2 * GiB, 0.5) == 18 * GiB
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_kv_cache_bytes(16 * GiB, 16 * GiB, 7 * GiB, 2 * GiB, 0.5)
