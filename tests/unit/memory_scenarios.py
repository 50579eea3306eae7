"""Memory scenarios run in a fresh interpreter each, so that measured memory is not noisy.

Usage: python tests/unit/memory_scenarios.py NAME [DEVICE]; prints one JSON object.
"""

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from memory import MemoryManager, cuda_device_memory_bytes, process_rss_bytes
from tests.memory_growth import private_rss_bytes

MiB = 1 << 20
# One intra-op thread: on a loaded machine, spinning OpenMP workers slow small copies a lot.
torch.set_num_threads(1)


def _used_bytes(manager: MemoryManager) -> int:
    """Private resident memory on CPU (without library pages the kernel may drop and fault
    back in: tests/memory_growth.py); device-wide used memory on CUDA."""
    if manager.device.type == "cuda":
        torch.cuda.synchronize(manager.device)
        torch.cuda.empty_cache()  # temporaries cached by torch are not pool memory
        return cuda_device_memory_bytes(manager.device)["device_used_bytes"]
    return private_rss_bytes()


def discard(device: str) -> dict[str, Any]:
    """Touch a pool fully, discard it, wake it, touch it again; measure after each step."""
    num_bytes = 256 * MiB if device.startswith("cuda") else 128 * MiB
    manager = MemoryManager(device)
    pool = manager.create_pool("kv_cache", num_bytes)
    data = pool.allocate(num_bytes // 4, torch.float32)  # [num_bytes / 4]
    data.fill_(1.0)
    ptr, used_touched = pool.data_ptr, _used_bytes(manager)
    manager.sleep("kv_cache", offload=False)
    used_released = _used_bytes(manager)
    manager.wake("kv_cache")
    used_woken = _used_bytes(manager)
    is_zero = bool((data == 0).all()) if device == "cpu" else None
    manager.mark_valid("kv_cache")
    data.fill_(2.0)
    used_retouched = _used_bytes(manager)
    return {
        "num_bytes": num_bytes,
        "used_touched": used_touched,
        "used_released": used_released,
        "used_woken": used_woken,
        "used_retouched": used_retouched,
        "is_zero_after_wake": is_zero,
        "same_ptr": pool.data_ptr == ptr and data.data_ptr() == ptr,
        "state": manager.state("kv_cache").value,
        "retouched_ok": bool((data == 2.0).all()),
    }


def offload(device: str) -> dict[str, Any]:
    """Offload random contents, wake, then discard: contents and released memory both checked."""
    # Large enough that a few MiB of allocator noise stay well inside the 5% bounds.
    num_bytes = 256 * MiB
    generator = torch.Generator().manual_seed(0)
    expected = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=generator)
    manager = MemoryManager(device)
    used_base = _used_bytes(manager)
    pool = manager.create_pool("weights", num_bytes)
    weights = pool.allocate((num_bytes // 2 // 1024, 1024), torch.bfloat16)  # [rows, 1024]
    pool.as_bytes().copy_(expected)  # host to device without a device temporary
    ptr, used_touched = pool.data_ptr, _used_bytes(manager)
    manager.sleep("weights", offload=True)
    used_offloaded = _used_bytes(manager)
    backup_bytes = manager.memory_state()["tags"]["weights"]["backup_bytes"]
    manager.wake("weights")
    used_woken = _used_bytes(manager)
    is_exact = torch.equal(pool.as_bytes().cpu(), expected)
    weights_ok = torch.equal(weights.view(torch.uint8).flatten().cpu(), expected)
    manager.sleep("weights", offload=False)
    return {
        "num_bytes": num_bytes,
        "used_base": used_base,
        "used_touched": used_touched,
        "used_offloaded": used_offloaded,
        "used_woken": used_woken,
        "used_discarded": _used_bytes(manager),
        "backup_bytes": backup_bytes,
        "is_exact": is_exact and weights_ok,
        "same_ptr": pool.data_ptr == ptr and weights.data_ptr() == ptr,
        "state": manager.state("weights").value,
    }


def _cycle(manager: MemoryManager, data: torch.Tensor, step: int) -> bool:
    """One sleep/wake cycle, offloading on even steps; True if contents behave as promised."""
    is_offload = step % 2 == 0
    data.fill_(step % 100)
    manager.sleep("weights", offload=is_offload)
    manager.wake("weights")
    if is_offload:
        is_ok = bool((data == step % 100).all())
    else:  # discarded memory comes back zeroed on CPU and undefined on CUDA
        is_ok = manager.device.type == "cuda" or bool((data == 0).all())
    manager.mark_valid("weights")
    return is_ok


def cycles(device: str, num_cycles: int = 500) -> dict[str, Any]:
    """Many offload and discard cycles; neither host memory nor device memory may grow. Both
    are measured after the warm-up, half-way and at the end (see tests/memory_growth.py)."""
    num_bytes = 64 * MiB if device.startswith("cuda") else 2 * MiB
    manager = MemoryManager(device)
    pool = manager.create_pool("weights", num_bytes)
    data = pool.allocate(num_bytes // 4, torch.float32)  # [num_bytes / 4]
    ptr = pool.data_ptr
    for step in range(20):  # warm-up: first-use allocations of torch and Python
        _cycle(manager, data, step)
    private_rss, used, num_ok = [private_rss_bytes()], [_used_bytes(manager)], 0
    rss_before = process_rss_bytes()
    for _ in range(2):  # two halves
        num_ok += sum(_cycle(manager, data, step) for step in range(num_cycles // 2))
        private_rss.append(private_rss_bytes())
        used.append(_used_bytes(manager))
    return {
        "num_bytes": num_bytes,
        "num_cycles": num_cycles,
        "num_ok": num_ok,
        "private_rss_bytes": private_rss,
        "used_bytes": used,
        "rss_before": rss_before,
        "rss_after": process_rss_bytes(),
        "same_ptr": pool.data_ptr == ptr and data.data_ptr() == ptr,
    }


def cuda_kernels(device: str) -> dict[str, Any]:
    """Torch kernels and a captured CUDA graph keep working on pool memory across cycles."""
    manager = MemoryManager(device)
    pool = manager.create_pool("kv_cache", 8 * MiB)
    data = pool.allocate((1024, 1024), torch.float32)  # [1024, 1024]
    data.fill_(1.0)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        data.add_(0.0)  # warm-up on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            data.mul_(2.0)
    torch.cuda.synchronize()
    data.fill_(1.0)
    manager.sleep("kv_cache", offload=True)
    manager.wake("kv_cache")
    graph.replay()
    after_offload = float(data.sum().item())
    manager.sleep("kv_cache", offload=False)
    manager.wake("kv_cache")
    manager.mark_valid("kv_cache")
    data.fill_(3.0)
    graph.replay()
    return {
        "after_offload": after_offload,
        "after_discard": float(data.sum().item()),
        "num_elements": data.numel(),
    }


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "discard": discard,
    "offload": offload,
    "cycles": cycles,
    "cuda_kernels": cuda_kernels,
}


if __name__ == "__main__":
    name, device = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "cpu")
    print(json.dumps(SCENARIOS[name](device)))
