"""Timestamped memory events of one process: sleep, wake, weight updates, pool transitions."""

import collections
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any


class MemoryEventLog:
    """A thread-safe list of events: {"time_s": unix seconds, "event": name, ...fields}.

    With `max_events`, only the newest that many are kept, so a long-lived process does not
    grow without bound.
    """

    def __init__(self, max_events: int | None = None) -> None:
        if max_events is not None and max_events < 1:
            raise ValueError(f"max_events must be >= 1 or None, got {max_events}")
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_events)
        self._lock = threading.Lock()

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
