"""How many OpenMP threads the forward uses on the CPU: all free cores, and fewer under load.

A forward is a chain of parallel regions, each ending in a barrier. When another busy
process shares a core with one of our threads, every region waits for that thread, and
the engine slows down several times (measured: 3.6x with two threads on two cores and one
busy process, where one thread slows down by 6%). So the default policy watches how much
CPU the rest of the machine uses, from `/proc/stat` minus our own share from
`/proc/self/stat`, and runs the forward on the cores nobody else is using (at least one).

The setting is per thread (OpenMP's is) and is applied around each forward, which on the
CPU runs on the caller's thread in both loops; the caller's own count is put back after it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

# A busy neighbour must hold this much of a core before we give it a core.
_BUSY_CORE_FRACTION = 0.5
_CHECK_INTERVAL_S = 0.5


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU time of the machine (busy, in all cores) and of this process."""

    machine_busy_s: float
    process_s: float
    wall_s: float


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_seconds(stat_path: str | os.PathLike[str] = "/proc/self/stat") -> float:
    """User + system CPU seconds a process (`/proc/PID/stat`) or one of its threads
    (`/proc/PID/task/TID/stat`) has used so far; OSError, ValueError where unreadable."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    # utime and stime are fields 14 and 15 of the whole stat line (11, 12 after the name).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_cpu_sample() -> CpuSample | None:
    """From /proc (Linux); None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        process_s = cpu_seconds()
    except (OSError, ValueError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return CpuSample(busy / ticks, process_s, time.monotonic())


class CpuThreadPolicy:
    """`threads()` before each forward: a fixed count, or the cores others leave free.

    Others' load is the machine's busy time minus ours, over the last interval of at least
    `check_interval_s`. Each core held by others for more than half the interval is given
    up (`max_threads` minus those, at least 1). With `fixed` set, that count is returned.
    """

    def __init__(
        self,
        fixed: int | None = None,
        max_threads: int | None = None,
        read: Callable[[], CpuSample | None] = read_cpu_sample,
        check_interval_s: float = _CHECK_INTERVAL_S,
    ) -> None:
        self.fixed = fixed
        self.max_threads = max_threads or usable_cores()
        self._read = read
        self._check_interval_s = check_interval_s
        self._last = read() if fixed is None else None
        self._threads = fixed or self.max_threads
        self.others_busy_cores = 0.0
        """Cores the rest of the machine kept busy over the last interval."""

    def threads(self) -> int:
        if self.fixed is not None or self._last is None:
            return self._threads
        sample = self._read()
        if sample is None or sample.wall_s - self._last.wall_s < self._check_interval_s:
            return self._threads
        elapsed = sample.wall_s - self._last.wall_s
        others = (sample.machine_busy_s - self._last.machine_busy_s) - (
            sample.process_s - self._last.process_s
        )
        self._last = sample
        self.others_busy_cores = max(0.0, others / elapsed)
        cores_taken = math.floor(self.others_busy_cores + (1 - _BUSY_CORE_FRACTION))
        self._threads = max(1, self.max_threads - cores_taken)
        return self._threads

    def run(self, fn: Callable[[T], R], arg: T) -> R:
        """`fn(arg)` with the thread count `threads()` gives, on this thread; the thread's own
        count (a per-thread setting) is put back afterwards."""
        import torch

        previous, num_threads = torch.get_num_threads(), self.threads()
        if previous == num_threads:
            return fn(arg)
        torch.set_num_threads(num_threads)
        try:
            return fn(arg)
        finally:
            torch.set_num_threads(previous)
