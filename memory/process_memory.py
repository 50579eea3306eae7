"""Resident memory of processes (Linux /proc) and used memory of a CUDA device."""

import os

import torch

_PAGE_SIZE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_rss_bytes(pid: int | None = None) -> int:
    """Resident set size of `pid` (this process by default), read from /proc/<pid>/statm."""
    path = f"/proc/{os.getpid() if pid is None else pid}/statm"
    try:
        with open(path, "rb") as statm:
            fields = statm.read().split()
    except FileNotFoundError:
        if not os.path.isdir("/proc/self"):
            raise NotImplementedError("process_rss_bytes needs Linux /proc") from None
        raise ProcessLookupError(f"no process with pid {pid}") from None
    num_resident_pages = int(fields[1])
    return num_resident_pages * _PAGE_SIZE_BYTES


def cuda_device_memory_bytes(device: torch.device | int | None = None) -> dict[str, int]:
    """Used and total bytes of a CUDA device as the driver sees them (all processes)."""
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    return {"device_used_bytes": total_bytes - free_bytes, "device_total_bytes": total_bytes}
