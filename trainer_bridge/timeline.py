"""A memory timeline of trainer and engine processes: sampled memory plus named phases."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, Self

from memory.process_memory import process_rss_bytes


def pid_listening_on(port: int) -> int | None:
    """The pid of this user's process with a TCP socket listening on `port` (Linux), if any:
    lets a trainer that was only given an engine's address sample the engine's memory."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as file:
                rows = file.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            is_listening = fields[3] == "0A"
            if is_listening and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for entry in os.listdir("/proc") if inodes else ():
        if not entry.isdigit():
            continue
        try:
            fd_dir = f"/proc/{entry}/fd"
            if any(os.readlink(os.path.join(fd_dir, fd)) in inodes for fd in os.listdir(fd_dir)):
                return int(entry)
        except OSError:
            continue
    return None


class _DeviceMemoryReader:
    """Device memory used per process (all GPUs), through NVML when it is installed."""

    def __init__(self) -> None:
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                             for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVML, no driver, or no GPU: RSS only
            self._handles = []

    @property
    def is_available(self) -> bool:
        return self._nvml is not None and bool(self._handles)

    def used_bytes(self) -> dict[int, int]:
        """pid -> device bytes, summed over devices."""
        used: dict[int, int] = {}
        for handle in self._handles:
            for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used[proc.pid] = used.get(proc.pid, 0) + int(proc.usedGpuMemory or 0)
        return used


class MemoryTimeline:
    """Resident (and, with NVML, device) memory of named processes sampled `hz` times a
    second on a background thread, plus phases ("generate", "sleep", "train", ...) with
    their start and end times. A sample is also taken at every phase boundary, so the
    memory a phase freed is measured exactly, whatever the sampling rate."""

    def __init__(self, pids: Mapping[str, int] | None = None, hz: float = 50.0) -> None:
        if hz <= 0:
            raise ValueError(f"hz must be > 0, got {hz}")
        self.pids: dict[str, int] = dict(pids or {"trainer": os.getpid()})
        self.hz = hz
        self.start_s = time.time()
        self.times_s: list[float] = []
        self.rss_bytes: dict[str, list[int]] = {role: [] for role in self.pids}
        self.device_bytes: dict[str, list[int]] = {role: [] for role in self.pids}
        self.phases: list[dict[str, Any]] = []
        self.pool_records: list[dict[str, Any]] = []
        """The engine's pools as `memory_state()` reported them: time, label, mapped bytes."""
        self._open: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._device = _DeviceMemoryReader()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------------------- sampling
    def set_pid(self, role: str, pid: int) -> None:
        """Follow another process under `role` from now on (e.g. a restarted engine)."""
        with self._lock:
            if role not in self.pids:
                length = len(self.times_s)
                self.rss_bytes[role], self.device_bytes[role] = [0] * length, [0] * length
            self.pids[role] = pid

    def sample(self) -> int:
        """Record one sample of every process now (0 for a process that has exited); its index."""
        device_used = self._device.used_bytes() if self._device.is_available else {}
        with self._lock:
            self.times_s.append(time.time() - self.start_s)
            for role, pid in self.pids.items():
                try:
                    rss = process_rss_bytes(pid)
                except (ProcessLookupError, OSError):
                    rss = 0
                self.rss_bytes[role].append(rss)
                self.device_bytes[role].append(device_used.get(pid, 0))
            return len(self.times_s) - 1

    def start(self) -> MemoryTimeline:
        if self._thread is not None:
            raise RuntimeError("the timeline is already sampling")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="memory-timeline", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        period_s = 1.0 / self.hz
        next_s = time.perf_counter()
        while not self._stop.is_set():
            self.sample()
            next_s += period_s
            delay_s = next_s - time.perf_counter()
            if delay_s < 0:  # fell behind: skip the missed ticks
                next_s, delay_s = time.perf_counter(), 0.0
            self._stop.wait(delay_s)

    def record_pools(self, label: str, mapped_bytes: Mapping[str, int]) -> None:
        """Record the bytes each engine pool has mapped now ("before_sleep", "after_wake", ...)."""
        with self._lock:
            self.pool_records.append({"time_s": time.time() - self.start_s, "label": label,
                                      "mapped_bytes": dict(mapped_bytes)})

    # ------------------------------------------------------------------------------ phases
    def begin(self, name: str, **fields: Any) -> None:
        """Open phase `name` (one open phase per name at a time)."""
        assert name not in self._open, f"phase {name!r} is already open"
        index = self.sample()
        self._open[name] = {"name": name, "start_s": self.times_s[index], "start_index": index,
                            **fields}

    def end(self, name: str, **fields: Any) -> None:
        """Close phase `name`; a no-op when it is not open."""
        phase = self._open.pop(name, None)
        if phase is None:
            return
        index = self.sample()
        phase.update(fields, end_s=self.times_s[index], end_index=index)
        phase["duration_s"] = phase["end_s"] - phase["start_s"]
        with self._lock:
            self.phases.append(phase)

    def end_all(self) -> None:
        for name in list(self._open):
            self.end(name)

    @contextlib.contextmanager
    def phase(self, name: str, **fields: Any) -> Iterator[None]:
        self.begin(name, **fields)
        try:
            yield
        finally:
            self.end(name)

    # ----------------------------------------------------------------------------- results
    def combined_bytes(self) -> list[int]:
        """Per sample: the sum over processes of resident plus device bytes."""
        with self._lock:
            columns = [*self.rss_bytes.values(), *self.device_bytes.values()]
            return [sum(values) for values in zip(*columns, strict=True)]

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "pids": dict(self.pids), "hz": self.hz, "start_unix_s": self.start_s,
                "time_s": list(self.times_s),
                "rss_bytes": {r: list(v) for r, v in self.rss_bytes.items()},
                "device_bytes": {r: list(v) for r, v in self.device_bytes.items()},
                "phases": [dict(p) for p in self.phases],
                "pool_records": [dict(r) for r in self.pool_records],
            }

    def save_json(self, path: str | os.PathLike[str], **extra: Any) -> None:
        with open(path, "w") as file:
            json.dump({**self.to_dict(), **extra}, file)

    def summary(self) -> dict[str, Any]:
        return summarize(self.to_dict())


def summarize(data: Mapping[str, Any]) -> dict[str, Any]:
    """Peaks, the sampling rate reached, and per phase name: count, median duration, and the
    median bytes each process freed over the phase (negative: it grew)."""
    roles = list(data["rss_bytes"])
    columns = [data["rss_bytes"][r] for r in roles] + [data["device_bytes"][r] for r in roles]
    combined = [sum(values) for values in zip(*columns, strict=True)]
    times_s = data["time_s"]

    def memory(role: str, index: int) -> int:
        return data["rss_bytes"][role][index] + data["device_bytes"][role][index]

    by_name: dict[str, list[dict[str, Any]]] = {}
    for phase in data["phases"]:
        by_name.setdefault(phase["name"], []).append(phase)
    phases = {}
    for name, items in by_name.items():
        freed = {
            role: statistics.median(memory(role, p["start_index"]) - memory(role, p["end_index"])
                                    for p in items)
            for role in roles
        }
        phases[name] = {
            "count": len(items),
            "median_duration_s": statistics.median(p["duration_s"] for p in items),
            "total_duration_s": sum(p["duration_s"] for p in items),
            "median_freed_bytes": freed,
        }
    duration_s = times_s[-1] - times_s[0] if len(times_s) > 1 else 0.0
    records = data.get("pool_records", [])
    released = [sum(a["mapped_bytes"].values()) - sum(b["mapped_bytes"].values())
                for a, b in itertools.pairwise(records)
                if a["label"] == "before_sleep" and b["label"] == "after_sleep"]
    return {
        "pool_bytes_released_per_sleep": statistics.median(released) if released else 0,
        "combined_peak_bytes": max(combined, default=0),
        "peak_bytes": {r: max((memory(r, i) for i in range(len(times_s))), default=0)
                       for r in roles},
        "num_samples": len(times_s),
        "samples_per_s": (len(times_s) - 1) / duration_s if duration_s > 0 else 0.0,
        "phases": phases,
    }


STEP_PHASES = ("generate", "sleep", "train", "wake_weights", "weight_sync", "reset_prefix_cache",
               "wake_kv_cache")
"""The phases of one colocated RL step, in the order a step runs them (from generation on)."""
PHASE_COLORS = {
    "generate": "tab:green", "sleep": "tab:red", "train": "tab:blue", "wake_weights": "tab:orange",
    "weight_sync": "tab:purple", "wake_kv_cache": "tab:olive", "reset_prefix_cache": "tab:gray",
}


def plot_timeline(data: Mapping[str, Any], path: str | os.PathLike[str], title: str = "") -> None:
    """Memory of each process and their sum over time, phases shaded; below, when recorded,
    the engine's pools as `memory_state()` reported them. Written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 1024.0**2
    times_s = data["time_s"]
    records = data.get("pool_records", [])
    if records:
        fig, (ax, pools) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True,
                                        gridspec_kw={"height_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(11, 4.5))
    total = [0.0] * len(times_s)
    for role in data["rss_bytes"]:
        values = [(r + d) / mib for r, d in zip(data["rss_bytes"][role], data["device_bytes"][role],
                                                strict=True)]
        total = [t + v for t, v in zip(total, values, strict=True)]
        ax.plot(times_s, values, lw=1.2, label=role)
    ax.plot(times_s, total, lw=1.6, color="black", label="combined")
    axes = [ax, pools] if records else [ax]
    seen = set()
    for phase in data["phases"]:
        name = phase["name"]
        for axis in axes:
            axis.axvspan(phase["start_s"], phase["end_s"], alpha=0.15, lw=0,
                         color=PHASE_COLORS.get(name, "tab:cyan"),
                         label=None if name in seen or axis is not ax else f"phase: {name}")
        seen.add(name)
    ax.set_ylabel("resident + device memory (MiB)")
    ax.set_title(title or "memory timeline")
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    if records:
        tags = sorted({tag for r in records for tag in r["mapped_bytes"]})
        record_times = [r["time_s"] for r in records]
        bottom = [0.0] * len(records)
        for tag in tags:
            values = [r["mapped_bytes"].get(tag, 0) / mib for r in records]
            top = [b + v for b, v in zip(bottom, values, strict=True)]
            pools.fill_between(record_times, bottom, top, step="post", alpha=0.6,
                               label=f"engine pool: {tag}")
            bottom = top
        pools.set_ylabel("engine pools mapped\n(memory_state, MiB)")
        pools.legend(loc="upper left", fontsize=7)
    axes[-1].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
