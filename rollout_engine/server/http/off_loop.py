"""Work a request can make expensive (rendering its chat template, tokenizing, detokenizing) runs
here, on a few threads of the HTTP front-end's own, never on the event loop that HTTP and gRPC
share: `/health`, gRPC calls and weight pushes go on while it runs.

Tokenizers release the GIL while they encode, and a template renders as Python code, which
yields the GIL every few milliseconds, so the event loop keeps its turn. The threads are
daemons: a template that never ends cannot hold up the server's exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
NUM_THREADS = 2
"""Two: one slow request (a long template) leaves a thread for everyone else."""


class OffLoopPool:
    """`await pool.run(fn, *args)`: `fn(*args)` on one of `num_threads` daemon threads; a call
    cancelled before its turn never runs."""

    def __init__(self, num_threads: int = NUM_THREADS, name: str = "http-tokenizer") -> None:
        self._work: queue.SimpleQueue[tuple[concurrent.futures.Future, Callable[[], Any]]] = (
            queue.SimpleQueue())
        for i in range(num_threads):
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True).start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._work.put((future, lambda: fn(*args)))
        return await asyncio.wrap_future(future)

    def _serve(self) -> None:
        while True:
            future, call = self._work.get()
            if not future.set_running_or_notify_cancel():
                continue  # its request has gone
            try:
                result = call()
            except BaseException as exc:  # noqa: BLE001 - the request's error, raised there
                future.set_exception(exc)
            else:
                future.set_result(result)
