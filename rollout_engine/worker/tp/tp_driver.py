"""Rank 0 of a tensor-parallel engine: a Worker that forwards every step and command.

The engine (scheduler, sampling, outputs) runs in this process against `DriverWorker`, which
has the same interface as `Worker`: each step's `SchedulerOutput` and each memory or weight
command goes to the other ranks (`RankProcesses`) before rank 0 applies it to its own shard;
the forward's collectives keep the ranks in step. A failed step breaks the group for good
(the ranks' collectives are out of step), and so does any rank that fails or dies: the
engine then refuses work with `RankFailedError`, naming the rank when one died or failed.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memory import MemoryEventLog
from rollout_engine.config import EngineConfig
from rollout_engine.core.scheduler_output import ModelRunnerOutput
from rollout_engine.protocol import MemoryState, RankFailedError, SleepLevel
from rollout_engine.worker.cpu_threads import usable_cores
from rollout_engine.worker.model_runner import PreparedStep
from rollout_engine.worker.models.registry import resolve_model_backend
from rollout_engine.worker.tp.tp_group import TPGroup, connect
from rollout_engine.worker.tp.tp_processes import RankProcesses
from rollout_engine.worker.tp.tp_rank import rank_device
from rollout_engine.worker.weights.weight_update import ManifestEntry
from rollout_engine.worker.worker import Worker


def cpu_threads_per_rank(config: EngineConfig) -> int:
    """CPU: each rank's OpenMP threads; the usable cores split between the ranks unless
    `cpu_threads` is set (threads of two ranks sharing a core stall every collective)."""
    size = config.parallel_config.tensor_parallel_size
    return config.model_config.cpu_threads or max(1, usable_cores() // size)


class DriverWorker(Worker):
    """Rank 0's Worker; starts ranks 1..N-1 and mirrors every step and command to them."""

    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        max_model_len: int,
        event_log: MemoryEventLog,
        on_weight_update: Callable[[], None],
    ) -> None:
        resolve_model_backend(config, hf_config)  # refused before any process starts
        self._broken: str | None = None
        self.ranks = RankProcesses(config, max_model_len, cpu_threads_per_rank(config))
        try:
            device = rank_device(config.model_config.device, 0)
            tp = self._connect(device, config.parallel_config.distributed_timeout_s)
            super().__init__(
                config, hf_config, max_model_len, event_log, on_weight_update, tp=tp,
                device=device,
            )
            rank_num_blocks = self.ranks.collect("loading the model")
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = min([self.num_blocks, *rank_num_blocks])
        self.weights.mirror = RankWeightMirror(self)

    def _connect(self, device: torch.device, timeout_s: float) -> TPGroup:
        """Join the group while watching the ranks: one that dies first fails at once (the
        joining thread is a daemon, left to its own timeout)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def join() -> None:
            try:
                future.set_result(connect(self.ranks.store, 0, self.ranks.size, device, timeout_s))
            except BaseException as exc:  # noqa: BLE001 - raised by the caller
                future.set_exception(exc)

        threading.Thread(target=join, name="tp-connect", daemon=True).start()
        while True:
            try:
                return future.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                failure, _ = self.ranks.failure("startup", grace_s=0.0)
                if failure is not None:
                    raise failure from None

    # ------------------------------------------------------------------ steps
    def check_ready(self) -> None:
        if self._broken is not None:
            raise RankFailedError(self._broken)
        super().check_ready()

    def run_model(self, prepared: PreparedStep) -> ModelRunnerOutput:
        if prepared.inputs is None:
            return super().run_model(prepared)
        self.check_ready()
        try:
            self.ranks.send("execute", prepared.scheduler_output)
            output = super().run_model(prepared)
        except RankFailedError as exc:
            raise self._break(exc) from exc
        except BaseException as exc:
            failure, silent_ranks = self.ranks.failure("a step")
            if failure is None and not silent_ranks:
                self.ranks.collect("a step")  # e.g. sampling failed here: the group is fine
                raise
            raise self._break(failure or _collective_failure("a step", exc, silent_ranks)) from exc
        try:
            self.ranks.collect("a step")
        except RankFailedError as exc:
            raise self._break(exc) from exc
        return output

    def drop_requests(self, scheduler_output) -> None:
        super().drop_requests(scheduler_output)
        self.call_ranks("drop_requests", scheduler_output)

    def _break(self, error: BaseException) -> BaseException:
        """Mark the group unusable and return `error`, to be raised."""
        self.tp.abort()  # ranks still waiting in a collective fail at once
        self._broken = (
            f"tensor parallelism failed earlier ({type(error).__name__}: {error}); the ranks "
            "are out of step: restart the engine"
        )
        return error

    def call_ranks(self, command, *args: Any) -> list[Any]:
        """Run a command on every other rank; a rank that fails or dies breaks the group."""
        if self._broken is not None:
            raise RankFailedError(self._broken)
        try:
            return self.ranks.call(command, *args)
        except RankFailedError as exc:
            raise self._break(exc) from exc

    # ------------------------------------------------------------------ memory
    def sleep(self, level: SleepLevel) -> None:
        self._mirror("sleep", super().sleep, level)

    def wake_up(self, tags: Sequence[str]) -> None:
        self._mirror("wake_up", super().wake_up, list(tags))

    def release_kv_cache(self) -> None:
        self._mirror("release_kv_cache", super().release_kv_cache)

    def _mirror(self, command, apply: Callable[..., None], *args: Any) -> None:
        """Apply the command here, then on every other rank. (Sequentially: applying it
        here may itself send commands, e.g. aborting an open weight update.)"""
        if self._broken is not None:
            raise RankFailedError(self._broken)
        apply(*args)
        self.call_ranks(command, *args)

    def rank_memory_states(self) -> list[MemoryState]:
        """Every rank's own memory state, rank 0 first."""
        return [self.memory_state(), *self.call_ranks("memory_state")]

    def shutdown(self) -> None:
        """Stop the other ranks' processes, leave the group and free this rank's pools."""
        self.ranks.shutdown()
        if getattr(self, "tp", None) is not None:
            self.tp.abort()
        if hasattr(self, "memory"):  # not when loading failed before the pools existed
            super().shutdown()


def _collective_failure(what: str, exc: BaseException, silent_ranks: list[int]) -> BaseException:
    """The error of collective work (`what`) that failed on rank 0 while other ranks had not
    finished it: they may have stopped answering (the group's timeout then fails rank 0's
    collective), or be waiting for rank 0, whose own part raised."""
    if not isinstance(exc, Exception):
        return exc  # KeyboardInterrupt and the like go up as they are
    return RankFailedError(
        f"{what} failed on tensor-parallel rank 0 ({type(exc).__name__}: {exc}); "
        f"rank(s) {', '.join(map(str, silent_ranks))} had not finished it; restart the engine"
    )


class RankWeightMirror:
    """Forwards a weight update to the other ranks: each full tensor is broadcast over the
    group, and every rank keeps its shard of it."""

    def __init__(self, driver: DriverWorker) -> None:
        self.driver = driver

    def begin(self, manifest: list[ManifestEntry]) -> None:
        self.driver.call_ranks("weights_begin", manifest)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        driver = self.driver
        device = driver.device if driver.device.type == "cuda" else torch.device("cpu")
        try:
            driver.ranks.send("weights_write", name, tuple(tensor.shape), tensor.dtype)
            driver.tp.broadcast(tensor.detach().to(device).contiguous(), root=0)
            driver.ranks.collect(f"writing {name!r}")
        except RankFailedError as exc:
            raise driver._break(exc) from exc
        except BaseException as exc:
            failure, silent_ranks = driver.ranks.failure(f"receiving {name!r}")
            error = failure or _collective_failure(f"sending {name!r}", exc, silent_ranks)
            raise driver._break(error) from exc

    def finish(self) -> None:
        self.driver.call_ranks("weights_finish")

    def abort(self, reason: str) -> None:
        if self.driver._broken is None:
            self.driver.call_ranks("weights_abort", reason)
