"""A tensor-parallel rank other than 0: a process that holds its shard and obeys rank 0.

Rank 0 sends commands over a pipe (`RankCommand`); the rank applies each to its own Worker
and answers ("ok", result) or ("error", message). Collectives (the forward's all-reduces, the
logits' all-gather, a weight tensor's broadcast) run on the process group meanwhile. A rank
whose step failed leaves: its collectives are out of step with the others for good. So does a
rank whose pipe to rank 0 closes (rank 0 exited).
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Literal

import torch

RankCommand = Literal[
    "execute", "drop_requests", "sleep", "wake_up", "release_kv_cache", "weights_begin", "weights_write",
    "weights_finish", "weights_abort", "memory_state", "shutdown",
]
"""What rank 0 asks of the other ranks; the arguments follow in the message."""

logger = logging.getLogger(__name__)


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: cuda:r on GPUs (one per rank), the CPU otherwise."""
    base = torch.device(device)
    if base.type == "cuda":
        return torch.device("cuda", (base.index or 0) + rank)
    return base


def rank_main(
    rank: int, size: int, port: int, config, max_model_len: int, num_threads: int, conn
) -> None:
    """Entry point of a rank's process: join the group, load the shard, serve commands."""
    try:
        torch.set_num_threads(num_threads)
        worker = _build_worker(rank, size, port, config, max_model_len)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        conn.send(("error", _describe(exc)))
        return
    conn.send(("ok", worker.num_blocks))
    RankLoop(worker, conn).run()


def _build_worker(rank: int, size: int, port: int, config, max_model_len: int):
    from memory import MemoryEventLog
    from rollout_engine.worker.tp.tp_group import connect, create_store
    from rollout_engine.worker.weights.loader import load_hf_config
    from rollout_engine.worker.worker import Worker

    timeout_s = config.parallel_config.distributed_timeout_s
    device = rank_device(config.model_config.device, rank)
    store = create_store(port, size, False, timeout_s)
    tp = connect(store, rank, size, device, timeout_s)
    hf_config = load_hf_config(config.model_config.model, config.model_config.model_impl)
    events = MemoryEventLog(config.memory_config.timeline_max_events)
    return Worker(config, hf_config, max_model_len, events, lambda: None, tp=tp, device=device)


class RankLoop:
    """Applies rank 0's commands to this rank's Worker, one at a time, in order."""

    def __init__(self, worker, conn) -> None:
        self.worker = worker
        self.conn = conn
        self.session = None
        """The open weight update session, if any."""

    def run(self) -> None:
        while True:
            try:
                command, args = self.conn.recv()
            except (EOFError, OSError):
                return  # rank 0 is gone
            if command == "shutdown":
                self.conn.send(("ok", None))
                return
            try:
                result = getattr(self, f"_{command}")(*args)
            except BaseException as exc:  # noqa: BLE001 - reported to rank 0
                self.conn.send(("error", _describe(exc)))
                if command == "execute":
                    self.worker.tp.abort()
                    return
                continue
            self.conn.send(("ok", result))

    def _execute(self, scheduler_output) -> None:
        self.worker.execute_model(scheduler_output)

    def _drop_requests(self, scheduler_output) -> None:
        self.worker.drop_requests(scheduler_output)

    def _sleep(self, level) -> None:
        self.worker.sleep(level)

    def _wake_up(self, tags) -> None:
        self.worker.wake_up(tags)

    def _release_kv_cache(self) -> None:
        self.worker.release_kv_cache()

    def _memory_state(self):
        return self.worker.memory_state()

    def _weights_begin(self, manifest) -> None:
        self.session = self.worker.weights.begin(manifest)

    def _weights_write(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        tp = self.worker.tp
        tensor = torch.empty(shape, dtype=dtype, device=_collective_device(self.worker))
        tp.broadcast(tensor, root=0)  # always received: the group stays in step
        if self.session is None:
            raise RuntimeError(f"rank {tp.rank} has no open weight update for {name!r}")
        self.session.write(name, tensor)

    def _weights_finish(self) -> int:
        session, self.session = self.session, None
        if session is None:
            raise RuntimeError(f"rank {self.worker.tp.rank} has no open weight update to finish")
        return session.finish()

    def _weights_abort(self, reason: str) -> None:
        self.session = None
        self.worker.weights.close_session(reason)


def _collective_device(worker) -> torch.device:
    """Where tensors sent over the group live: the GPU for NCCL, the CPU for gloo."""
    return worker.device if worker.device.type == "cuda" else torch.device("cpu")


def _describe(exc: BaseException) -> str:
    detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    logger.debug("rank %s: %s", os.getpid(), traceback.format_exc())
    return detail
