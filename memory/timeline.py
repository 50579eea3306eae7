"""Timestamped memory events and a background sampler of process and device memory."""

import collections
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from memory.process_memory import cuda_device_memory_bytes, process_rss_bytes


class MemoryTimeline:
    """A thread-safe list of events: {"time_s": unix seconds, "event": name, ...fields}.

    With `max_events`, only the newest that many are kept, so a long-lived process does not
    grow without bound.
    """

    def __init__(self, max_events: int | None = None) -> None:
        if max_events is not None and max_events < 1:
            raise ValueError(f"max_events must be >= 1 or None, got {max_events}")
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_events)
        self._lock = threading.Lock()
        self._sampler: _Sampler | None = None

    def record(
        self,
        event: str,
        *,
        phase: str | None = None,
        tag: str | None = None,
        num_bytes: int | None = None,
        **extra: Any,
    ) -> None:
        """Append one event; fields left as None are omitted."""
        entry: dict[str, Any] = {"time_s": time.time(), "event": event}
        fields = {"phase": phase, "tag": tag, "num_bytes": num_bytes, **extra}
        entry.update((key, value) for key, value in fields.items() if value is not None)
        with self._lock:
            self._events.append(entry)

    @contextlib.contextmanager
    def span(self, event: str, **fields: Any) -> Iterator[None]:
        """Record `event` with phase "begin", then "end" (or "error") with its duration_s."""
        self.record(event, phase="begin", **fields)
        start_s = time.perf_counter()
        try:
            yield
        except BaseException as error:
            duration_s = time.perf_counter() - start_s
            self.record(event, phase="error", duration_s=duration_s, error=repr(error), **fields)
            raise
        self.record(event, phase="end", duration_s=time.perf_counter() - start_s, **fields)

    @property
    def events(self) -> list[dict[str, Any]]:
        """A copy of the events recorded so far, oldest first."""
        with self._lock:
            return list(self._events)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write {"pid": writer's pid, "events": [...]} to `path`."""
        with open(path, "w") as file:
            json.dump({"pid": os.getpid(), "events": self.events}, file)

    @property
    def is_sampling(self) -> bool:
        return self._sampler is not None

    def start_sampling(
        self, hz: float = 50.0, pids: Sequence[int] | None = None, include_cuda: bool = True
    ) -> None:
        """Record a "sample" event per pid (rss_bytes) about `hz` times a second.

        With `include_cuda`, and only if this process already initialized CUDA, each tick also
        records the current device's used bytes (all processes) as a "sample" with `device`.
        """
        if hz <= 0:
            raise ValueError(f"hz must be > 0, got {hz}")
        if self._sampler is not None:
            raise RuntimeError("the timeline is already sampling; call stop_sampling() first")
        cuda_index = None
        if include_cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda_index = torch.cuda.current_device()
        pids = [os.getpid()] if pids is None else list(pids)
        self._sampler = _Sampler(self, 1.0 / hz, pids, cuda_index)

    def stop_sampling(self) -> None:
        """Stop the sampler (if any) and wait for its thread to end."""
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.stop()


class _Sampler:
    """A daemon thread that samples on a fixed schedule, skipping ticks it fell behind on."""

    def __init__(
        self, timeline: MemoryTimeline, period_s: float, pids: list[int], cuda_index: int | None
    ) -> None:
        self._timeline = timeline
        self._period_s = period_s
        self._pids = pids
        self._cuda_index = cuda_index
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_s = time.perf_counter()
        while not self._stop.is_set():
            self._sample_once()
            next_s += self._period_s
            delay_s = next_s - time.perf_counter()
            if delay_s < 0:
                next_s, delay_s = time.perf_counter(), 0.0
            self._stop.wait(delay_s)

    def _sample_once(self) -> None:
        for pid in self._pids:
            try:
                rss_bytes = process_rss_bytes(pid)
            except (ProcessLookupError, OSError):
                continue  # the process ended; keep sampling the others
            self._timeline.record("sample", pid=pid, rss_bytes=rss_bytes)
        if self._cuda_index is not None:
            device_bytes = cuda_device_memory_bytes(self._cuda_index)
            self._timeline.record("sample", device=f"cuda:{self._cuda_index}", **device_bytes)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
