"""The engine's state as both sides see it: memory pools and their tags, sleep levels and
modes, the memory state per tag, the engine's facts, and the wire constants."""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rollout_engine.protocol.exceptions import InvalidRequestError

SERVICE_NAME = "rollout.v1.RolloutEngine"
"""Full name of the gRPC service (also the health-check service name)."""
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024**2
"""Largest gRPC message either way, by default, on both sides."""

WEIGHTS_TAG = "weights"
KV_CACHE_TAG = "kv_cache"
MEMORY_TAGS: tuple[str, ...] = (WEIGHTS_TAG, KV_CACHE_TAG)
"""The engine's memory pools, in the order they are created and woken."""
LORA_TAG = "lora"
"""With LoRA enabled, the adapters' device slots: a pool that follows the weights (released by
every sleep, mapped again with them; its contents are a cache of the adapters' host copies)."""

SleepMode = Literal["abort", "wait", "keep"]
"""What sleep does to in-flight requests (vLLM's modes): end them with finish reason "abort",
drain them ("wait"), or freeze them ("keep"): they resume where they were, their KV
recomputed from their tokens."""
PauseMode = Literal["abort", "wait", "keep"]
"""What `pause_generation` does to in-flight requests (vLLM's `PauseMode`): the same three, a
kept request's KV staying unless the pause clears the cache (`clear_cache=False`)."""
SLEEP_MODES: tuple[str, ...] = ("abort", "wait", "keep")
"""The modes of sleep and of pause, which are the same three."""


class SleepLevel(enum.IntEnum):
    """How deeply the engine sleeps (vLLM's levels)."""

    OFFLOAD_WEIGHTS = 1
    """Weights copied to a host backup, KV cache discarded: wake_up() restores them."""
    DISCARD_ALL = 2
    """Weights and KV cache discarded: the weights must be pushed again after wake_up()."""

    @classmethod
    def parse(cls, level: object) -> SleepLevel:
        """The level for 1, 2 or a SleepLevel; InvalidRequestError for anything else."""
        if isinstance(level, int) and not isinstance(level, bool):
            try:
                return cls(level)
            except ValueError:
                pass
        raise InvalidRequestError(
            f"sleep level must be 1 (offload weights to host memory, discard the KV cache) "
            f"or 2 (discard both), got {level!r}"
        )


def check_sleep_mode(mode: object) -> SleepMode:
    """`mode` as a sleep's or a pause's mode; InvalidRequestError naming the three."""
    if mode not in SLEEP_MODES:
        raise InvalidRequestError(f"mode must be 'abort', 'wait' or 'keep', got {mode!r}")
    return mode  # type: ignore[return-value]


def check_memory_tags(tags: Sequence[str] | None) -> list[str]:
    """The tags to wake, in pool order (all for None); InvalidRequestError naming the valid ones."""
    if tags is None:
        return list(MEMORY_TAGS)
    if isinstance(tags, str) or not isinstance(tags, Sequence):
        raise InvalidRequestError(
            f"tags must be a list of memory tags such as ['weights'], got {tags!r}; "
            f"valid tags: {list(MEMORY_TAGS)}"
        )
    for tag in tags:
        if tag not in MEMORY_TAGS:
            raise InvalidRequestError(
                f"unknown memory tag {tag!r}; valid tags: {list(MEMORY_TAGS)}"
            )
    return [tag for tag in MEMORY_TAGS if tag in tags]

@dataclass(frozen=True)
class TagMemoryState:
    """One memory pool as the user sees it."""

    state: str
    """"awake", "offloaded" (contents in a host backup) or "discarded" (contents lost)."""
    mapped: bool
    """Whether physical memory backs the pool right now."""
    num_bytes: int
    """Capacity of the pool."""


@dataclass(frozen=True)
class MemoryState:
    """A snapshot of the engine's memory, as `memory_state()` returns it."""

    tags: dict[str, TagMemoryState]
    pool_bytes: dict[str, int]
    """Capacity of each pool, by tag."""
    is_sleeping: bool
    """True while any pool's memory is released."""
    weights_valid: bool
    """False after sleep(level=2) and during (or after a cut-off) weight update."""
    process_rss_bytes: int
    """Resident memory of the engine process."""
    device_memory: dict[str, int] = field(default_factory=dict)
    """{"device_used_bytes", "device_total_bytes"} on CUDA, empty on CPU."""


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is and how it is doing: model, limits, KV blocks, counters."""

    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    dtype: str
    """torch dtype name without "torch.", e.g. "bfloat16"."""
    device: str
    weight_version: int
    config_json: str
    """The EngineConfig as JSON, grouped by concern."""
    num_blocks: int
    num_free_blocks: int
    block_size: int
    eos_token_ids: list[int]
    is_sleeping: bool
    weights_valid: bool
    engine_stats: dict[str, float] = field(default_factory=dict)
    """Preemptions, prefix-cache hits, speculative decoding (spec_acceptance_rate, ...)."""
    num_unfinished_requests: int = 0
    """Prompts the engine holds (running or waiting)."""
    num_inflight_requests: int = 0
    """Server: samples admitted and not yet answered."""
    max_inflight_requests: int = 0
    """Server: the admission limit, in samples."""
    num_requests_total: int = 0
    """Server: prompts added since start."""
    num_generated_tokens_total: int = 0
    """Server: tokens of finished completions since start."""

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json or "{}")
