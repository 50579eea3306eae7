"""The engine's memory: weights and KV cache pools, sleep/wake transitions, readiness checks."""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Literal

import torch

from memory import MemoryEventLog, MemoryManager, MemoryPool, TagState
from rollout_engine.protocol import (
    KV_CACHE_TAG,
    LORA_TAG,
    WEIGHTS_TAG,
    EngineSleepingError,
    MemoryState,
    SleepLevel,
    TagMemoryState,
    UnavailableError,
)

# Why the weights' contents are not valid, for the error a caller sees.
_DiscardCause = Literal["sleep", "update"]


class EngineMemory:
    """Owns the MemoryManager with one pool for the weights and one for the KV cache.

    A tag woken from "discarded" is zero-filled at once: on CPU that makes its pages
    resident now (the memory is claimed at wake time, as on a GPU), and on CUDA it clears
    contents the driver leaves undefined, so stale bytes never reach attention.
    """

    def __init__(self, device: torch.device, event_log: MemoryEventLog | None = None) -> None:
        self.manager = MemoryManager(device, event_log)
        self._weights_discard_cause: _DiscardCause | None = None
        self._is_ready = True
        self._is_closed = False
        # Python's garbage collector never gives driver memory (CUDA virtual memory) back:
        # an engine dropped without shutdown() frees its pools when it is collected. Not at
        # exit, where the process gives everything back and the driver may be gone first.
        self._free_pools = weakref.finalize(self, self.manager.close)
        self._free_pools.atexit = False

    def close(self) -> None:
        """Free both pools for good (the engine's shutdown); its tensors must not be used
        afterwards, and `check_ready()` says so. Idempotent."""
        self._is_ready, self._is_closed = False, True
        self._free_pools()

    # ------------------------------------------------------------------ pools
    def create_weights_pool(self, num_bytes: int) -> MemoryPool:
        """The pool the model's parameters are carved out of (`ModelBackend.load`)."""
        return self.manager.create_pool(WEIGHTS_TAG, num_bytes)

    def create_lora_pool(self, num_bytes: int) -> MemoryPool:
        """The pool of the LoRA adapters' device slots (see `LORA_TAG`)."""
        return self.manager.create_pool(LORA_TAG, num_bytes)

    @property
    def has_lora_pool(self) -> bool:
        return LORA_TAG in self.manager.tags()

    def allocate_kv_cache(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The KV cache tensor, zero-filled, as the only tenant of the "kv_cache" pool."""
        num_bytes = math.prod(shape) * dtype.itemsize
        pool = self.manager.create_pool(KV_CACHE_TAG, num_bytes)
        pool.zero_()
        return pool.allocate(shape, dtype)

    # ------------------------------------------------------------------ transitions
    def sleep(self, level: SleepLevel) -> None:
        """Level 1: weights to a host backup, KV discarded. Level 2: both discarded."""
        self.manager.sleep(WEIGHTS_TAG, offload=level == SleepLevel.OFFLOAD_WEIGHTS)
        if level == SleepLevel.DISCARD_ALL:
            self.manager.mark_invalid(WEIGHTS_TAG)  # also drops a backup of an earlier level 1
            self._weights_discard_cause = "sleep"
        self.manager.sleep(KV_CACHE_TAG, offload=False)
        if self.has_lora_pool:  # a cache of the adapters' host copies: discarded, never copied
            self.manager.sleep(LORA_TAG, offload=False)
        self._update_ready()

    def release_kv_cache(self) -> None:
        self.manager.sleep(KV_CACHE_TAG, offload=False)
        self._update_ready()

    def wake_up(self, tags: Sequence[str]) -> None:
        """Map the named tags again; offloaded weights come back, discarded ones stay invalid."""
        for tag in tags:
            if self.manager.is_mapped(tag):
                continue
            self.manager.wake(tag)
            if self.manager.state(tag) is TagState.DISCARDED:
                self.manager.pool(tag).zero_()
        if KV_CACHE_TAG in tags:
            self.manager.mark_valid(KV_CACHE_TAG)  # KV is scratch: mapped means usable
        if WEIGHTS_TAG in tags and self.has_lora_pool and not self.manager.is_mapped(LORA_TAG):
            self.manager.wake(LORA_TAG)
            self.manager.pool(LORA_TAG).zero_()
            self.manager.mark_valid(LORA_TAG)  # empty slots, filled as steps need them
        self._update_ready()

    def begin_weight_update(self) -> None:
        """Mark the weights inconsistent until `finish_weight_update()`."""
        self.manager.mark_invalid(WEIGHTS_TAG)
        self._weights_discard_cause = "update"
        self._update_ready()

    def finish_weight_update(self) -> None:
        self.manager.mark_valid(WEIGHTS_TAG)
        self._weights_discard_cause = None
        self._update_ready()

    # ------------------------------------------------------------------ checks
    @property
    def weights_valid(self) -> bool:
        """Awake, or offloaded with a backup: the contents need no update."""
        return self.manager.state(WEIGHTS_TAG) is not TagState.DISCARDED

    @property
    def weights_mapped(self) -> bool:
        return self.manager.is_mapped(WEIGHTS_TAG)

    @property
    def is_ready(self) -> bool:
        """Weights awake and valid, KV cache mapped: the model may run."""
        return self._is_ready

    def check_ready(self) -> None:
        """EngineSleepingError saying what to call, unless the model may run."""
        if self._is_ready:
            return
        if self._is_closed:
            raise UnavailableError("the engine is shut down: its memory is freed; build a new one")
        problems = [p for p in (self._weights_problem(), self._kv_problem()) if p]
        raise EngineSleepingError("cannot generate: " + "; and ".join(problems))

    def check_weights_mapped(self) -> None:
        """EngineSleepingError unless the weights pool is mapped (so it can be written)."""
        if not self.weights_mapped:
            raise EngineSleepingError(
                "the weights are asleep; call wake_up(['weights']) before updating them"
            )

    def _weights_problem(self) -> str | None:
        state, mapped = self.manager.state(WEIGHTS_TAG), self.weights_mapped
        if state is TagState.AWAKE:
            return None
        if state is TagState.OFFLOADED:
            return "the weights are offloaded to host memory by sleep(level=1); call wake_up(['weights'])"
        if not mapped:
            return (
                "the weights are released and their contents discarded; call wake_up(['weights']), "
                "then update_weights(...) with every parameter"
            )
        if self._weights_discard_cause == "sleep":
            return (
                "the weights were discarded by sleep(level=2); call update_weights(...) "
                "with every parameter first"
            )
        return (
            "a weight update is in progress or was cut off; finish a complete "
            "update_weights(...) first"
        )

    def _kv_problem(self) -> str | None:
        if self.manager.is_mapped(KV_CACHE_TAG):
            return None
        return "the KV cache is released; call wake_up(['kv_cache'])"

    def _update_ready(self) -> None:
        self._is_ready = (
            self.manager.state(WEIGHTS_TAG) is TagState.AWAKE
            and self.manager.is_mapped(KV_CACHE_TAG)
            and (not self.has_lora_pool or self.manager.is_mapped(LORA_TAG))
        )

    # ------------------------------------------------------------------ accounting
    def state(self) -> MemoryState:
        raw = self.manager.memory_state()
        tags = {
            tag: TagMemoryState(entry["state"], entry["mapped"], entry["bytes"])
            for tag, entry in raw["tags"].items()
        }
        return MemoryState(
            tags=tags,
            pool_bytes={tag: entry.num_bytes for tag, entry in tags.items()},
            is_sleeping=not all(entry.mapped for entry in tags.values()),
            weights_valid=self.weights_valid,
            process_rss_bytes=raw["process_rss_bytes"],
            device_memory={k: int(v) for k, v in raw.items() if k.startswith("device_")},
        )
