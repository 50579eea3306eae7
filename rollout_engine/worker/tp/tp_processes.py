"""Rank 0's handles on the other tensor-parallel ranks: their processes and command pipes.

Every wait is bounded: an answer that does not come within the timeout, a rank whose process
exited, or one that reported an error raises `RankFailedError` naming the rank.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import time
import weakref
from typing import Any

from rollout_engine.protocol import RankFailedError
from rollout_engine.worker.tp.tp_group import create_store
from rollout_engine.worker.tp.tp_rank import RankCommand, rank_main

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 5.0


class RankProcesses:
    """Ranks 1..size-1, started with multiprocessing's "spawn" (each loads its own shard).

    `store` is the rendezvous the ranks join; rank 0 joins it with `tp_group.connect`. The
    processes are stopped by `shutdown()`, and also when this object is collected or the
    interpreter exits.
    """

    def __init__(self, config, max_model_len: int, num_threads: int) -> None:
        self.size = config.parallel_config.tensor_parallel_size
        self.timeout_s = config.parallel_config.distributed_timeout_s
        self.store = create_store(0, self.size, True, self.timeout_s)
        context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self._early_answers: dict[int, tuple[str, Any]] = {}
        """Answers `failure()` read before `collect()` asked for them."""
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns)
        for rank in range(1, self.size):
            parent_conn, child_conn = context.Pipe()
            process = context.Process(
                target=rank_main, name=f"tp-rank-{rank}", daemon=True,
                args=(rank, self.size, self.store.port, config, max_model_len, num_threads,
                      child_conn),
            )
            process.start()
            child_conn.close()  # so that the rank's exit closes the pipe here
            self.processes.append(process)
            self.conns.append(parent_conn)

    @property
    def ranks(self) -> range:
        return range(1, self.size)

    def send(self, command: RankCommand, *args: Any) -> None:
        """The command to every rank, without waiting for their answers."""
        for rank, conn in zip(self.ranks, self.conns):
            try:
                conn.send((command, args))
            except (BrokenPipeError, ConnectionError, OSError) as exc:
                raise RankFailedError(
                    f"tensor-parallel rank {rank} is gone (its pipe is closed: {exc}); "
                    "restart the engine"
                ) from exc

    def collect(self, what: str, timeout_s: float | None = None) -> list[Any]:
        """Every rank's answer to the last command, in rank order; RankFailedError naming
        the first rank that failed, died or did not answer within the timeout."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        results = []
        for rank, conn, process in zip(self.ranks, self.conns, self.processes):
            answer = self._early_answers.pop(rank, None)
            answer = answer or self._answer(rank, conn, process, what, deadline)
            if answer is None:
                raise RankFailedError(
                    f"tensor-parallel rank {rank} did not answer {what} within {timeout_s:g} s "
                    "(distributed_timeout_s); restart the engine"
                )
            status, value = answer
            if status != "ok":
                raise RankFailedError(f"tensor-parallel rank {rank} failed {what}: {value}")
            results.append(value)
        return results

    def call(self, command: RankCommand, *args: Any) -> list[Any]:
        """Send a command and wait for every rank's answer."""
        self.send(command, *args)
        return self.collect(command.replace("_", " "))

    def failure(self, what: str, grace_s: float = 2.0) -> tuple[RankFailedError | None, list[int]]:
        """After something failed on rank 0: the error of a rank that reported one or exited
        within `grace_s` (or None), and the ranks that had not answered by then."""
        deadline = time.monotonic() + grace_s
        silent_ranks = []
        for rank, conn, process in zip(self.ranks, self.conns, self.processes):
            if rank not in self._early_answers:
                try:
                    answer = self._answer(rank, conn, process, what, deadline)
                except RankFailedError as exc:
                    return exc, []
                if answer is None:
                    silent_ranks.append(rank)
                    continue
                self._early_answers[rank] = answer
            status, value = self._early_answers[rank]
            if status != "ok":
                return RankFailedError(f"tensor-parallel rank {rank} failed {what}: {value}"), []
        return None, silent_ranks

    def _answer(self, rank, conn, process, what: str, deadline: float) -> tuple[str, Any] | None:
        """The rank's ("ok" | "error", value), or None if none came by the deadline;
        RankFailedError if its process exited without answering."""
        ready = multiprocessing.connection.wait(
            [conn, process.sentinel], timeout=max(0.0, deadline - time.monotonic())
        )
        if conn in ready or conn.poll():
            try:
                return conn.recv()
            except (EOFError, OSError):
                pass  # it exited without answering
        if not ready:
            return None
        process.join(1.0)
        raise RankFailedError(
            f"tensor-parallel rank {rank} died during {what} (exit code {process.exitcode}); "
            "restart the engine"
        )

    def shutdown(self) -> None:
        """Ask every rank to exit; those still running after a grace period are killed."""
        self._finalizer()


def _stop(processes: list, conns: list) -> None:
    for conn in conns:
        try:
            conn.send(("shutdown", ()))
        except (BrokenPipeError, ConnectionError, OSError):
            pass
    deadline = time.monotonic() + _SHUTDOWN_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            logger.warning("tensor-parallel rank %s did not exit; killing it", process.name)
            process.kill()
            process.join(1.0)
    for conn in conns:
        conn.close()
