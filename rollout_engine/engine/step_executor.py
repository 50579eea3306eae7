"""How a step's forward overlaps the host's work: one `StepExecutor` per concurrency mode.

An executor owns the steps in flight and nothing else. `launch()` starts a step's forward
(or, on the CPU under async scheduling, readies it to run beside the next step's host work),
`overlap(host_work)` runs the host work of the next step while the oldest step computes, and
`land()` waits for the oldest step: a `LandedStep`, or `FailedSteps` with every step launched
after it (they read its tokens), discarded unrun where they had not started. `land()` never
raises half-way: what the forward raised, Ctrl-C included, comes back as `FailedSteps`.

- `SyncExecutor`: the forward runs inside `launch()`, on the caller's thread.
- `ForwardThreadExecutor` (async scheduling on a GPU): the forward runs on an
  `engine-forward` thread, which waits for the device with the GIL released, while the caller
  schedules and prepares the next step.
- `HostThreadExecutor` (async scheduling on the CPU): the roles swap. The forward stays on
  the caller's thread and the next step is scheduled on an `engine-host` thread with one
  OpenMP thread: a forward on a second thread of ours would give OpenMP two pools of workers
  on the same cores, and with more workers than cores libgomp's workers sleep at every
  barrier instead of spinning (measured: 20% slower).
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

    from rollout_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from rollout_engine.worker.model_runner import PreparedStep

T = TypeVar("T")
RunModel = Callable[["PreparedStep"], "ModelRunnerOutput"]


@dataclass
class LandedStep:
    """A step whose forward and sampling completed."""

    scheduler_output: SchedulerOutput
    runner_output: ModelRunnerOutput


@dataclass
class FailedSteps:
    """The oldest step failed (`error`); it and every step launched after it, oldest first."""

    scheduler_outputs: list[SchedulerOutput]
    error: BaseException


class StepExecutor:
    """The steps in flight, oldest first, and the rule that a failed step takes the later
    ones with it. Subclasses decide where a forward runs."""

    max_in_flight = 1

    def __init__(self, run_model: RunModel) -> None:
        self._run_model = run_model
        self._in_flight: deque[tuple[SchedulerOutput, concurrent.futures.Future]] = deque()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def is_full(self) -> bool:
        return len(self._in_flight) >= self.max_in_flight

    def oldest_is_done(self) -> bool:
        """Whether the oldest step's result is there without waiting (a failed launch)."""
        return bool(self._in_flight) and self._in_flight[0][1].done()

    def launch(
        self,
        scheduler_output: SchedulerOutput,
        prepared: concurrent.futures.Future[PreparedStep],
        host_work: Callable[[PreparedStep], None],
    ) -> None:
        """Start a step whose inputs are `prepared` (a failed preparation lands as the step's
        failure). `host_work(step)` (its grammar bitmask) runs while the forward can already
        start, and before its sampling needs it."""
        if prepared.exception() is not None:
            self._in_flight.append((scheduler_output, prepared))
            return
        self._in_flight.append((scheduler_output, self._start(prepared.result(), host_work)))

    def _start(self, step: PreparedStep, host_work) -> concurrent.futures.Future:
        host_work(step)
        return run_here(self._run_model, step)

    def overlap(self, host_work: Callable[[], T]) -> T:
        """Run the next step's host work (scheduling, preparing inputs) beside the oldest
        step's forward; here: just run it."""
        return host_work()

    def land(self) -> LandedStep | FailedSteps:
        """Wait for the oldest step in flight and hand it over."""
        scheduler_output, future = self._in_flight[0]
        try:
            self._run_if_deferred(future)
            runner_output = future.result()
        except BaseException as exc:  # noqa: BLE001 - handed to the engine as FailedSteps
            concurrent.futures.wait([future])  # Ctrl-C while waiting: let the step finish
            return FailedSteps(self._discard_all(), exc)
        self._in_flight.popleft()
        return LandedStep(scheduler_output, runner_output)

    def _discard_all(self) -> list[SchedulerOutput]:
        """Pop every step in flight; those launched after the failed one must not outlive
        it (they read its tokens): the unstarted ones never run, the others are waited for."""
        outputs = []
        while self._in_flight:
            scheduler_output, future = self._in_flight.popleft()
            if isinstance(future, _DeferredForward):
                future.discard()
            concurrent.futures.wait([future])
            outputs.append(scheduler_output)
        return outputs

    def _run_if_deferred(self, future: concurrent.futures.Future) -> None:
        pass

    def shutdown(self) -> None:
        """Stop the executor's thread, if any; a step in flight is waited for."""


class SyncExecutor(StepExecutor):
    """The synchronous loop: schedule, run, land, all on the caller's thread."""


class ForwardThreadExecutor(StepExecutor):
    """Async scheduling on a GPU: forwards run, in launch order, on an `engine-forward`
    thread bound to the engine's device."""

    max_in_flight = 2

    def __init__(self, run_model: RunModel, device: torch.device) -> None:
        super().__init__(run_model)
        # The initializer must not hold the engine: the thread would keep it alive.
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="engine-forward", initializer=_bind_to_device,
            initargs=(device,),
        )

    def _start(self, step: PreparedStep, host_work) -> concurrent.futures.Future:
        future = self._thread.submit(self._run_model, step)
        host_work(step)  # while the forward runs; its sampling waits for the bitmask
        return future

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)


class HostThreadExecutor(StepExecutor):
    """Async scheduling on the CPU: a launched step's forward runs on the caller's thread at
    the next `overlap()` (or `land()`), while the host thread does the next step's host work;
    only the host thread touches the scheduler meanwhile."""

    max_in_flight = 2

    def __init__(self, run_model: RunModel) -> None:
        super().__init__(run_model)
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="engine-host", initializer=_one_openmp_thread
        )

    def _start(self, step: PreparedStep, host_work) -> concurrent.futures.Future:
        host_work(step)
        return _DeferredForward(self._run_model, step)

    def overlap(self, host_work: Callable[[], T]) -> T:
        """The first step of a run has no forward to overlap with: its host work runs here."""
        forward = self._in_flight[0][1] if self._in_flight else None
        if not isinstance(forward, _DeferredForward) or forward.done():
            return host_work()
        host = self._thread.submit(host_work)
        try:
            forward.run()  # a failure lands with the step
        finally:
            concurrent.futures.wait([host])  # Ctrl-C here: the scheduler is ours again first
        return host.result()

    def _run_if_deferred(self, future: concurrent.futures.Future) -> None:
        if isinstance(future, _DeferredForward):
            future.run()  # not run yet (landed by sleep...): run it now

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)


def make_executor(async_scheduling: bool, device: torch.device, run_model: RunModel
                  ) -> StepExecutor:
    """The synchronous loop; under async scheduling the forward on its own thread (GPU), or
    the next step's host work on its own thread (CPU)."""
    if not async_scheduling:
        return SyncExecutor(run_model)
    if device.type == "cpu":
        return HostThreadExecutor(run_model)
    return ForwardThreadExecutor(run_model, device)


def run_here(fn: Callable[..., T], *args) -> concurrent.futures.Future[T]:
    """`fn(*args)` run on this thread, as a done future: its result or what it raised."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - whoever lands the future gets it
        future.set_exception(exc)
    return future


class _DeferredForward(concurrent.futures.Future):
    """A step's forward that runs when the executor says so, on the thread that says so;
    discarded if a step before it fails."""

    def __init__(self, run_model: RunModel, prepared: PreparedStep) -> None:
        super().__init__()
        self._run_model, self._prepared = run_model, prepared

    def run(self) -> None:
        """Run the forward unless it already ran or was discarded; a failure is its result."""
        if self.done() or self.running() or not self.set_running_or_notify_cancel():
            return
        run_model, prepared = self._run_model, self._prepared
        self._run_model = self._prepared = None  # a landed step holds no inputs
        try:
            self.set_result(run_model(prepared))
        except BaseException as exc:  # noqa: BLE001 - whoever lands the future gets it
            self.set_exception(exc)

    def discard(self) -> None:
        """Never run it; it counts as done (cancelled) from now on."""
        if self.cancel():
            self.set_running_or_notify_cancel()  # `concurrent.futures.wait` sees it done
        self._run_model = self._prepared = None


def _one_openmp_thread() -> None:
    """The CPU host thread runs no parallel work: no OpenMP pool of its own."""
    import torch

    torch.set_num_threads(1)


def _bind_to_device(device: torch.device) -> None:
    if device.type == "cuda":  # the forward thread launches on the engine's GPU
        import torch

        torch.cuda.set_device(device)
