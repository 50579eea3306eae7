"""One process's place in a tensor-parallel group and the collectives the model uses.

The group is a process group of its own (gloo on CPU, NCCL on CUDA) built straight from a
TCP store, not `init_process_group`: the default group of the process stays free for a
trainer that shares it. Its timeout bounds every collective, so a rank that stops answering
fails the step instead of hanging the others.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

TP_STORE_PREFIX = "rollout_engine_tp"


class TPGroup:
    """Rank `rank` of `size`; with size 1 every collective is the identity and no process
    group exists. Without a process group (shape planning on the meta device) the
    collectives of a larger group must not be called."""

    def __init__(self, rank: int = 0, size: int = 1, process_group=None) -> None:
        assert 0 <= rank < size, f"rank {rank} out of a group of {size}"
        self.rank = rank
        self.size = size
        self.process_group = process_group

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, samples and forwards every command to the others."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        if self.size > 1:
            self.process_group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x`, concatenated along `dim` in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.process_group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Rank `root`'s `x` on every rank, in place (`x` must be contiguous)."""
        if self.size > 1:
            options = dist.BroadcastOptions()
            options.rootRank = root
            self.process_group.broadcast([x], options).wait()
        return x

    def abort(self) -> None:
        """Drop the connections (after a peer failed; the group is unusable afterwards)."""
        if self.process_group is not None:
            self.process_group.abort()
            self.process_group = None


def create_store(port: int, size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store on 127.0.0.1; the master passes port 0 to pick a free one."""
    return dist.TCPStore(
        "127.0.0.1", port, size, is_master, timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def connect(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float
) -> TPGroup:
    """Join the group (blocks until every rank has joined, at most `timeout_s`)."""
    prefixed = dist.PrefixStore(TP_STORE_PREFIX, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds the communicator to the current device
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        process_group = dist.ProcessGroupNCCL(prefixed, rank, size, options)
    else:
        process_group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    return TPGroup(rank, size, process_group)
