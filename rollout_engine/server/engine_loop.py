"""The engine thread, private to `AsyncEngine`: runs commands between steps, streams outputs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeVar

import torch

from rollout_engine.protocol import (
    EngineBusyError,
    EngineError,
    EngineSleepingError,
    InternalError,
    LoRARequest,
    PauseMode,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    SleepLevel,
    SleepMode,
    StepFailedError,
)

if TYPE_CHECKING:
    from rollout_engine.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")
PauseState = Literal["running", "draining", "paused"]


class OutputSink:
    """Where the engine thread delivers one call's outputs: an asyncio queue.

    `output_kind` is what the call's prompts are added with: FINAL_ONLY costs the engine and
    the event loop nothing until a prompt finishes; streams (DELTA kinds) carry only news.
    """

    def __init__(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.output_kind = output_kind
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    async def get(self) -> RequestOutput:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


@dataclass
class _Drain:
    """A Sleep or PauseGeneration with mode "wait", waiting for the prompts that were in flight
    when it came; then `then()` runs (the sleep, or the pause).

    Until then it gates new prompts: a sleep's are refused, a pause's held for the resume. A
    resume during a pause's drain cancels the pause (`then` becomes None): its caller still
    hears once its prompts are done, not paused (vLLM's `pause_generation` returns too, once
    the engine is idle, and leaves it running)."""

    then: Callable[[], Any] | None
    what: Literal["sleep", "pause"]
    done: concurrent.futures.Future[int] = field(default_factory=concurrent.futures.Future)
    request_ids: set[str] = field(default_factory=set)
    """The prompts in flight when it began (set on the engine thread)."""

    @property
    def is_pausing(self) -> bool:
        """A pause's drain that no resume cancelled: generation reads as paused already."""
        return self.what == "pause" and self.then is not None


class PauseResult(NamedTuple):
    """What a PauseGeneration did."""

    num_requests: int
    """The prompts it ended ("abort"), drained ("wait") or kept ("keep")."""
    is_paused: bool
    """False only for "wait" when a resume came during the drain: it drained, did not pause."""


@dataclass
class _HeldAdd:
    """Requests that came during a PauseGeneration "wait" drain: added once it paused (they
    then queue for the resume, as vLLM's pause queues them), so the drain can end."""

    requests: list[tuple[str, str | list[int], SamplingParams]]
    sink: OutputSink
    prompt_logprobs_from: Sequence[int] | None
    lora_request: LoRARequest | None
    done: concurrent.futures.Future[None]


class EngineLoop:
    """Every engine call happens on this thread; `AsyncEngine` talks to it through `call`. The
    server's "wait" drain (a sleep or pause once the prompts in flight finished) lives here,
    once: the engine itself is asked to sleep or pause with "abort" or "keep" only.

    A failed step ends the prompts it scheduled (`LLMEngine.step`); their calls get the
    step's error as their status, and every other call goes on.
    """

    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._sinks: dict[str, OutputSink] = {}
        self._drains: list[_Drain] = []
        self._held: list[_HeldAdd] = []
        self._is_stopping = False
        self._crash: BaseException | None = None
        self._busy_since_s: float | None = None  # monotonic start of the running step/command
        self._thread = threading.Thread(target=self._main, name="engine-loop", daemon=True)
        self.num_requests_total = 0

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
        if self._crash is not None:
            self._fail_commands()  # nobody else will: the thread is gone
        return future

    def is_responsive(self, stall_s: float) -> bool:
        """The engine thread is alive and no step or command has run for `stall_s` or more."""
        if self._crash is not None or not self._thread.is_alive():
            return False
        busy_since_s = self._busy_since_s
        return busy_since_s is None or time.monotonic() - busy_since_s < stall_s

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Await `fn(*args)` run on the engine thread; its exception is raised here."""
        return await asyncio.wrap_future(self.submit(lambda: fn(*args)), loop=self._loop)

    async def add_requests(
        self,
        requests: list[tuple[str, str | list[int], SamplingParams]],
        sink: OutputSink,
        prompt_logprobs_from: Sequence[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Add all requests or none: if one is refused, those already added are aborted.
        `prompt_logprobs_from`: per request, the first prompt position whose logprobs it asks
        for (scoring); None: every position but the first. `lora_request`: the adapter they
        run under (None: the base model)."""
        held = await self.call(self._add_requests, requests, sink, prompt_logprobs_from,
                               lora_request)
        if held is not None:  # during a pause drain: added once paused
            await asyncio.wrap_future(held, loop=self._loop)

    def abort(self, request_ids: list[str]) -> None:
        """Fire and forget: safe from a cancelled handler's `finally`."""
        self.submit(lambda: self._abort(request_ids))

    async def call_ending_requests(self, fn: Callable[[], list[RequestOutput]]) -> int:
        """Run an engine call that ends requests (sleep, release); their final outputs reach
        the waiting streams. Returns how many prompts it ended."""
        return await self.call(self._call_ending_requests, fn)

    async def sleep(self, level: SleepLevel, mode: SleepMode) -> int:
        """Sleep with the requests in flight ended ("abort"), kept ("keep"), or first drained
        ("wait": steps go on meanwhile, new prompts are refused). Returns how many prompts it
        ended, kept or drained."""
        if mode == "wait":
            drain = await self._after_drain(
                _Drain(functools.partial(self._engine.sleep, level, mode="abort"), "sleep"))
            return len(drain.request_ids)
        return await self._end_or_keep(functools.partial(self._engine.sleep, level, mode=mode),
                                       mode)

    async def pause(self, mode: PauseMode, clear_cache: bool = True) -> PauseResult:
        """Pause generation as `sleep` does its memory. During a "wait" drain generation reads
        as paused and new prompts are held (they queue for the resume once paused); a resume
        meanwhile cancels the pause (see `_Drain`)."""
        if mode == "wait":
            drain = await self._after_drain(_Drain(
                functools.partial(self._engine.pause_generation, "abort", clear_cache), "pause"))
            return PauseResult(len(drain.request_ids), is_paused=drain.then is not None)
        num_requests = await self._end_or_keep(
            functools.partial(self._engine.pause_generation, mode, clear_cache), mode)
        return PauseResult(num_requests, is_paused=True)

    async def resume(self) -> None:
        """Generation goes on: kept prompts, those held during a "wait" drain, and the prompts
        of a drain that was to end in a pause (it no longer will)."""
        await self.call(self._resume)

    async def is_paused(self) -> bool:
        """Paused, or draining to pause ("wait"): no new prompt starts until a resume."""
        return await self.call(self._pause_state) != "running"

    async def _end_or_keep(self, freeze: Callable[[], list[RequestOutput]], mode: SleepMode
                           ) -> int:
        if mode == "keep":
            return await self.call(self._keep_while, freeze)
        return await self.call_ending_requests(freeze)

    def _keep_while(self, freeze: Callable[[], Any]) -> int:
        """On the engine thread: `freeze()` (a sleep or pause in "keep" mode); the prompts kept."""
        freeze()
        return self._engine.num_unfinished_requests

    async def _after_drain(self, drain: _Drain) -> _Drain:
        """Begin `drain` on the engine thread; it, once answered."""
        self.submit(lambda: self._begin_drain(drain))
        await asyncio.wrap_future(drain.done, loop=self._loop)
        return drain

    def counters(self) -> dict[str, int]:
        return {
            "num_requests_total": self.num_requests_total,
            "num_generated_tokens_total": self._engine.output_processor.num_finished_tokens,
        }

    # ------------------------------------------------------------------ on the engine thread
    def _main(self) -> None:
        try:
            device = self._engine.device
            if device.type == "cuda":  # launches and syncs go to the engine's GPU (cuda:N)
                torch.cuda.set_device(device)
            self._run()
        except BaseException as exc:
            logger.critical("the engine thread crashed; every call now fails", exc_info=exc)
            self._crash = exc
            error = InternalError(f"the engine thread crashed: {type(exc).__name__}: {exc}")
            sinks = {id(s): s for s in self._sinks.values()}
            self._sinks.clear()
            if sinks:
                self._loop.call_soon_threadsafe(_deliver, [(s, error) for s in sinks.values()])
            for waiting in [*self._drains, *self._held]:
                if not waiting.done.cancelled():  # a caller that has gone cancelled its own
                    waiting.done.set_exception(error)
            self._fail_commands()

    def _run(self) -> None:
        # A paused engine, or one asleep with requests kept, waits for commands (resume, wake)
        # instead of stepping in vain.
        while not self._is_stopping:
            self._run_commands(block=not self._engine.can_make_progress())
            if not self._is_stopping and self._engine.can_make_progress():
                self._step()
            self._finish_drains()

    def _step(self) -> None:
        self._busy_since_s = time.monotonic()
        try:
            outputs = self._engine.step()
        except BaseException as exc:  # noqa: BLE001 - a failed step must not take the server down
            self._fail(exc)
            return
        finally:
            self._busy_since_s = None
        self._dispatch(outputs)

    def _run_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                # Not busy before the caller hears back: health read right after a command
                # returns must not see a stall that has ended.
                self._busy_since_s = time.monotonic()
                try:
                    result = fn()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    self._busy_since_s = None
                    future.set_exception(exc)
                else:
                    self._busy_since_s = None
                    future.set_result(result)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_commands(self) -> None:
        """After a crash: every queued command fails instead of waiting forever."""
        error = InternalError(f"the engine thread crashed: {self._crash!r}")
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

    def _request_stop(self) -> None:
        self._is_stopping = True

    def _add_requests(
        self,
        requests: list[tuple[str, str | list[int], SamplingParams]],
        sink: OutputSink,
        prompt_logprobs_from: Sequence[int] | None,
        lora_request: LoRARequest | None,
    ) -> concurrent.futures.Future[None] | None:
        """Add the requests now, or, during a pause drain, hold them: the future then says
        when they were added (or why not)."""
        gate = self._gate()
        if gate is not None and gate.what == "pause":
            held = _HeldAdd(requests, sink, prompt_logprobs_from, lora_request,
                            concurrent.futures.Future())
            self._held.append(held)
            return held.done
        self._add_now(requests, sink, prompt_logprobs_from, lora_request)
        return None

    def _gate(self) -> _Drain | None:
        """The first drain that still has a sleep or pause to run: new prompts wait for it, or
        are refused (EngineSleepingError) when it is a sleep's."""
        self._drains = [d for d in self._drains if not d.done.cancelled()]  # callers gone
        gate = next((d for d in self._drains if d.then is not None), None)
        if gate is not None and gate.what == "sleep":
            raise EngineSleepingError(
                "the engine is draining its requests to go to sleep (Sleep with mode 'wait'); "
                "wake it up after the sleep, then generate"
            )
        return gate

    def _add_now(
        self,
        requests: list[tuple[str, str | list[int], SamplingParams]],
        sink: OutputSink,
        prompt_logprobs_from: Sequence[int] | None,
        lora_request: LoRARequest | None,
    ) -> None:
        added: list[str] = []
        try:
            for i, (request_id, prompt, sampling_params) in enumerate(requests):
                options = {} if prompt_logprobs_from is None else {
                    "prompt_logprobs_from": prompt_logprobs_from[i]}
                self._engine.add_request(request_id, prompt, sampling_params, sink.output_kind,
                                        lora_request=lora_request, **options)
                added.append(request_id)
        except Exception:
            self._engine.abort_request(added)
            raise
        for request_id in added:
            self._sinks[request_id] = sink
        self.num_requests_total += len(added)

    def _release_held(self) -> None:
        """Once no pause drain holds them (it paused, or a resume cancelled it): add what came
        meanwhile, or refuse it if a sleep's drain is next."""
        if not self._held or self._is_draining_to_pause():
            return
        held, self._held = self._held, []
        for add in held:
            if not add.done.set_running_or_notify_cancel():
                continue  # aborted while held
            try:
                self._gate()
                self._add_now(add.requests, add.sink, add.prompt_logprobs_from, add.lora_request)
            except Exception as exc:  # noqa: BLE001 - the caller's error
                add.done.set_exception(exc)
            else:
                add.done.set_result(None)

    def _abort(self, request_ids: list[str]) -> None:
        aborted = set(request_ids)
        for add in self._held:
            if aborted & {request_id for request_id, _, _ in add.requests}:
                add.done.cancel()  # its caller has gone; never added
        self._held = [add for add in self._held if not add.done.cancelled()]
        self._engine.abort_request(request_ids)

    def _call_ending_requests(self, fn: Callable[[], list[RequestOutput]]) -> int:
        outputs = fn() or []
        self._dispatch(outputs)
        return len(outputs)

    def _begin_drain(self, drain: _Drain) -> None:
        if self._engine.is_paused():  # the caller waits on `done`: it gets the error there
            drain.done.set_exception(EngineBusyError(
                f"generation is paused: its requests cannot drain before the {drain.what}; use "
                "mode 'keep' or 'abort', or resume first"
            ))
            return
        drain.request_ids = set(self._engine.unfinished_request_ids)
        self._drains.append(drain)
        self._finish_drains()

    def _finish_drains(self) -> None:
        """Answer, in order, every drain whose prompts have all finished, after running its
        sleep or pause (none if a resume cancelled it); then release the held requests."""
        while self._drains:
            drain = self._drains[0]
            if not drain.done.cancelled() and (
                drain.request_ids & set(self._engine.unfinished_request_ids)
            ):
                break
            self._drains.pop(0)
            if not drain.done.set_running_or_notify_cancel():
                continue  # its caller has gone: nothing is paused or slept
            try:
                if drain.then is not None:
                    self._call_ending_requests(drain.then)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                drain.done.set_exception(exc)
            else:
                drain.done.set_result(len(drain.request_ids))
        self._release_held()

    def _resume(self) -> None:
        """The one way out of a pause, drained or draining (see `resume`)."""
        for drain in self._drains:
            if drain.what == "pause":
                drain.then = None
        self._engine.resume_generation()
        self._finish_drains()

    def _pause_state(self) -> PauseState:
        """"paused" (nothing is scheduled), "draining" (a "wait" pause waits for its prompts;
        new ones are held) or "running"; a sleep's drain is no pause (it refuses new ones)."""
        if self._engine.is_paused():
            return "paused"
        return "draining" if self._is_draining_to_pause() else "running"

    def _is_draining_to_pause(self) -> bool:
        return any(d.is_pausing and not d.done.cancelled() for d in self._drains)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its sink with one wake-up of the event loop per step."""
        deliveries: list[tuple[OutputSink, RequestOutput | BaseException]] = []
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if output.finished:
                self._sinks.pop(output.request_id, None)
            if sink is not None:
                deliveries.append((sink, output))
        if deliveries:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    def _fail(self, exc: BaseException) -> None:
        """Give a failed step's error to the calls of the prompts it ended.

        The engine ended exactly those (`request_ids` on the error). Without that list the
        failure came from outside the step's compute, so every prompt is ended.
        """
        request_ids = getattr(exc, "request_ids", None)
        logger.error("engine step failed (%s: %s); ending %s prompts", type(exc).__name__, exc,
                     "all" if request_ids is None else len(request_ids), exc_info=exc)
        if request_ids is None:
            request_ids = list(self._sinks)
            try:
                self._engine.abort_request(self._engine.unfinished_request_ids)
            except Exception:
                logger.exception("abort after a failed step failed too")
        error = exc if isinstance(exc, EngineError) else StepFailedError(
            f"a step failed and its prompts were ended: {type(exc).__name__}: {exc}"
        )
        sinks = {id(s): s for s in (self._sinks.pop(rid, None) for rid in request_ids) if s}
        if sinks:
            self._loop.call_soon_threadsafe(_deliver, [(s, error) for s in sinks.values()])


def _deliver(deliveries: list[tuple[OutputSink, RequestOutput | BaseException]]) -> None:
    for sink, item in deliveries:
        sink.queue.put_nowait(item)
