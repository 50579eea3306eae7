"""Memory growth judged the way a leak shows: private resident bytes at three checkpoints of a
run of cycles, and the growth of the half that grew least.

A leak grows by the same amount in both halves. What else moves resident memory, and is no
leak, lands in one half at most: the heap growing once (measured over 2,000 engine cycles: a
step of 0.2 to 5.4 MB at some cycle, then about 20 bytes a cycle), and library pages the kernel
dropped under memory pressure and faults back in (about 8 MB; file-backed, so counted by total
RSS and not by private RSS).
"""

from __future__ import annotations

import ctypes
import ctypes.util


def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (it has `malloc_trim`), else None."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_GLIBC = _glibc()

MAX_LEAK_BYTES_PER_CYCLE = 1024
"""What a cycle may leave behind: 250 cycles may leak 250 KiB. The engine's cycles grow by
about 20 bytes a cycle once settled; a leaked event, backup or request grows by far more."""


def private_rss_bytes(pid: int | None = None) -> int:
    """Anonymous and shared-memory resident bytes of a process, this one by default
    (/proc/PID/status): heap, pools, host backups; without the file-backed pages of its
    libraries. In this process free heap memory is first given back (glibc's `malloc_trim`):
    it would hide a leak until used up."""
    if pid is None and _GLIBC is not None:
        _GLIBC.malloc_trim(0)
    fields = {}
    with open(f"/proc/{'self' if pid is None else pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024  # kB
    return fields["RssAnon"] + fields["RssShmem"]


def leak_bytes(checkpoints: list[int]) -> int:
    """Growth of the half that grew least, from [start, middle, end] of a run."""
    start, middle, end = checkpoints
    return min(middle - start, end - middle)


def max_leak_bytes(num_cycles: int) -> int:
    """The bound on `leak_bytes` of a run of `num_cycles`."""
    return MAX_LEAK_BYTES_PER_CYCLE * num_cycles // 2
