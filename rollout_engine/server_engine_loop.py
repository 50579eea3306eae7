"""The engine thread: owns the LLMEngine, runs commands between steps, streams outputs back."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from rollout_engine.outputs import RequestOutput
from rollout_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rollout_engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")


class OutputSink:
    """Where the engine thread delivers one gRPC call's outputs: an asyncio queue.

    With `finals_only`, an output is delivered only when one more completion has finished,
    so a large batch costs the event loop nothing while it runs.
    """

    def __init__(self, finals_only: bool = False) -> None:
        self.finals_only = finals_only
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._num_finished: dict[str, int] = {}

    def wants(self, output: RequestOutput) -> bool:
        """Called on the engine thread."""
        if not self.finals_only:
            return True
        num_finished = sum(o.finished for o in output.outputs)
        if num_finished <= self._num_finished.get(output.request_id, 0):
            return False
        self._num_finished[output.request_id] = num_finished
        return True

    async def get(self) -> RequestOutput:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class EngineLoop:
    """Every engine call happens on this thread; handlers talk to it through `call`."""

    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self._loop = loop
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._sinks: dict[str, OutputSink] = {}
        self._is_stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.num_requests_total = 0
        self.num_generated_tokens_total = 0

    # -------------------------------------------------------------- used from the event loop
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the command queue, then end the thread (requests still running are dropped)."""
        self.submit(self._request_stop)
        self._thread.join(timeout_s)

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn()` on the engine thread before its next step."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((fn, future))
        return future

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Await `fn(*args)` run on the engine thread; its exception is raised here."""
        return await asyncio.wrap_future(self.submit(lambda: fn(*args)), loop=self._loop)

    async def add_requests(
        self, requests: list[tuple[str, str | list[int], SamplingParams]], sink: OutputSink
    ) -> None:
        """Add all requests or none: if one is refused, those already added are aborted."""
        await self.call(self._add_requests, requests, sink)

    def abort(self, request_ids: list[str]) -> None:
        """Fire and forget: safe from a cancelled handler's `finally`."""
        self.submit(lambda: self.engine.abort_request(request_ids))

    async def call_dispatching(self, fn: Callable[..., list[RequestOutput]], *args: Any) -> int:
        """Run an engine call that ends requests (sleep, release); their outputs reach the
        waiting streams. Returns how many requests it ended."""
        return await self.call(self._call_dispatching, fn, args)

    def counters(self) -> dict[str, int]:
        return {
            "num_requests_total": self.num_requests_total,
            "num_generated_tokens_total": self.num_generated_tokens_total,
        }

    # ------------------------------------------------------------------ on the engine thread
    def _run(self) -> None:
        while not self._is_stopping:
            self._run_commands(block=not self.engine.has_unfinished_requests())
            if self._is_stopping or not self.engine.has_unfinished_requests():
                continue
            try:
                self._dispatch(self.engine.step())
            except Exception as exc:  # a failed step must not take the server down
                logger.exception("engine step failed; aborting its requests")
                self._fail_all(exc)

    def _run_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _request_stop(self) -> None:
        self._is_stopping = True

    def _add_requests(
        self, requests: list[tuple[str, str | list[int], SamplingParams]], sink: OutputSink
    ) -> None:
        added: list[str] = []
        try:
            for request_id, prompt, sampling_params in requests:
                self.engine.add_request(request_id, prompt, sampling_params)
                added.append(request_id)
        except Exception:
            self.engine.abort_request(added)
            raise
        for request_id in added:
            self._sinks[request_id] = sink
        self.num_requests_total += len(added)

    def _call_dispatching(self, fn: Callable[..., list[RequestOutput]], args: tuple) -> int:
        outputs = fn(*args) or []
        self._dispatch(outputs)
        return len(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its sink with one wake-up of the event loop per step."""
        deliveries: list[tuple[OutputSink, RequestOutput | BaseException]] = []
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if output.finished:
                self._sinks.pop(output.request_id, None)
                self.num_generated_tokens_total += sum(len(o.token_ids) for o in output.outputs)
            if sink is not None and sink.wants(output):
                deliveries.append((sink, output))
        if deliveries:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    def _fail_all(self, exc: Exception) -> None:
        deliveries = [(sink, exc) for sink in self._sinks.values()]
        request_ids = list(self._sinks)
        self._sinks.clear()
        try:
            self.engine.abort_request(request_ids)
        except Exception:
            logger.exception("abort after a failed step failed too")
        if deliveries:
            self._loop.call_soon_threadsafe(_deliver, deliveries)


def _deliver(deliveries: list[tuple[OutputSink, RequestOutput | BaseException]]) -> None:
    for sink, item in deliveries:
        sink.queue.put_nowait(item)
