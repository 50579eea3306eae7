"""What changes a running engine between steps: pause, sleep, wake, KV release, weight updates."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

from rollout_engine.protocol import (
    KV_CACHE_TAG,
    EngineBusyError,
    InvalidRequestError,
    RequestOutput,
    SleepLevel,
    check_memory_tags,
)

if TYPE_CHECKING:
    from memory import MemoryEventLog
    from rollout_engine.core.scheduler import Scheduler
    from rollout_engine.engine.output_processor import OutputProcessor
    from rollout_engine.engine.step_landing import StepLander
    from rollout_engine.worker.weights.weight_update import (
        ManifestEntry,
        NamedTensors,
        WeightUpdateSession,
    )
    from rollout_engine.worker.worker import Worker

logger = logging.getLogger(__name__)

EngineMode = Literal["abort", "keep"]
"""What `sleep` and `pause` do with the requests in flight: end or keep them. Draining them
first ("wait") is the policy of a loop that steps the engine: `LLM` offline, the server's
engine loop."""


class EngineControl:
    """The engine's verbs between steps. Each lands the steps in flight first (memory never
    changes under a running forward) and ends ("abort", through `abort`, the engine's) or
    keeps ("keep") the requests in flight."""

    def __init__(
        self,
        scheduler: Scheduler,
        worker: Worker,
        lander: StepLander,
        output_processor: OutputProcessor,
        memory_events: MemoryEventLog,
        abort: Callable[[list[str]], None],
    ) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.lander = lander
        self.output_processor = output_processor
        self.memory_events = memory_events
        self._abort = abort

    @property
    def is_frozen(self) -> bool:
        """Requests wait where they are: generation is paused, or the memory is asleep with
        requests kept across the sleep."""
        return self.scheduler.is_paused or not self.worker.is_ready

    # ------------------------------------------------------------------ sleep and wake
    def sleep(self, level: int, mode: EngineMode) -> list[RequestOutput]:
        """Release memory. Level 1: weights to a host backup, KV discarded; level 2: both
        discarded. The requests in flight are first ended ("abort"; their final outputs are
        returned) or kept ("keep"): frozen, their KV dropped with the pool, they go on (their
        KV recomputed from their tokens) once the engine is awake with valid weights again,
        whatever weights those are."""
        level, mode = SleepLevel.parse(level), check_engine_mode(mode)
        with self.memory_events.span("engine_sleep", level=int(level), mode=mode):
            outputs = self._end_or_keep_requests(mode, drop_kv=True)
            self.worker.sleep(level)
            self.scheduler.reset_prefix_cache()
        return outputs

    def wake_up(self, tags: Sequence[str] | None) -> None:
        """Map the named pools ("weights", "kv_cache"; all by default) again at the same
        addresses. Offloaded weights are restored. Weights discarded by sleep(level=2) stay
        invalid until a complete `update_weights`. Waking the KV cache resets the prefix
        cache. Requests kept across a level-2 sleep stay frozen until that update (not an
        error: the RL step pushes the weights next); a warning says so."""
        tags = check_memory_tags(tags)
        with self.memory_events.span("engine_wake_up", tags=tags):
            self.lander.land_all()
            self.worker.wake_up(tags)
            if KV_CACHE_TAG in tags:
                self.scheduler.reset_prefix_cache()
        memory = self.worker.memory_state()
        num_kept = len(self.output_processor)
        if num_kept and not memory.is_sleeping and not memory.weights_valid:
            logger.warning(
                "%d kept requests wait for a weight update: the weights (discarded by "
                "sleep(level=2)) are invalid until a complete update_weights(...)", num_kept)

    def release_kv_cache(self) -> list[RequestOutput]:
        """Abort the requests in flight and release the KV pool only; their final outputs."""
        with self.memory_events.span("engine_release_kv_cache_memory"):
            outputs = self._end_or_keep_requests("abort", drop_kv=True)
            self.worker.release_kv_cache()
            self.scheduler.reset_prefix_cache()
        return outputs

    # ------------------------------------------------------------------ pause
    def pause(self, mode: EngineMode, clear_cache: bool) -> list[RequestOutput]:
        """Stop scheduling at a step boundary (vLLM's `pause_generation`): "abort" ends what
        is in flight (their final outputs are returned), "keep" freezes it. Kept requests are,
        in ledger terms, preempted by recompute when `clear_cache` (their KV and the prefix
        cache dropped: recomputed on resume with the weights then loaded), or running requests
        that are not scheduled when not (their KV, from the weights of before, stays: an
        approximation). With "abort", `clear_cache` resets the prefix cache (as vLLM's does).
        New requests queue until `resume()`, also while the weights are asleep or half written
        (vLLM's pause blocks them the same way); weight updates are allowed while paused."""
        outputs = self._end_or_keep_requests(check_engine_mode(mode), drop_kv=clear_cache)
        self.scheduler.is_paused = True  # nothing is in flight: nothing is scheduled after this
        if clear_cache:
            self.scheduler.reset_prefix_cache()
        return outputs

    def resume(self) -> None:
        """Schedule again: kept requests go on where they were."""
        self.scheduler.is_paused = False

    def _end_or_keep_requests(self, mode: EngineMode, drop_kv: bool) -> list[RequestOutput]:
        """Land every step in flight, with every unfinished prompt aborted ("abort": their
        final outputs, in arrival order) or kept ("keep": preempted by recompute if `drop_kv`,
        else left running, unscheduled)."""
        outputs: list[RequestOutput] = []
        if mode == "abort":
            group_ids = self.output_processor.group_ids
            self._abort(group_ids)
            outputs = self.output_processor.final_outputs(group_ids, self._weight_version)
        self.lander.land_all()
        if mode == "keep" and drop_kv:
            self.scheduler.preempt_all_running()
        return outputs

    # ------------------------------------------------------------------ weight updates
    def update_weights(self, named_tensors: NamedTensors) -> int:
        """Copy new values into the parameters, all checked first; the new weight version."""
        self._check_no_generation()
        return self.worker.weights.update(named_tensors)

    def begin_weight_update(self, manifest: Sequence[ManifestEntry]) -> WeightUpdateSession:
        """Validate every (name, shape, dtype) before a byte is written, then open a session.
        A refused manifest changes nothing. Once open, generation is refused until the
        session's `finish()`; an open earlier session is aborted (superseded)."""
        self._check_no_generation()
        return self.worker.weights.begin(manifest)

    def _check_no_generation(self) -> None:
        self.lander.land_all()  # a step in flight for a finished request still reads weights
        if self.is_frozen:  # paused or asleep: kept requests go on with the new weights
            return
        num_generating = self.output_processor.num_generating()
        if num_generating:
            raise EngineBusyError(
                f"{num_generating} requests are still generating; let them finish or abort them "
                f"(e.g. sleep(mode='abort')) before updating weights, so that no completion "
                f"mixes two weight versions"
            )

    @property
    def _weight_version(self) -> int:
        return self.worker.weights.weight_version


def check_engine_mode(mode: object) -> EngineMode:
    """InvalidRequestError, saying where "wait" lives, unless `mode` is "abort" or "keep"."""
    if mode not in ("abort", "keep"):
        raise InvalidRequestError(
            f"LLMEngine.sleep and pause_generation take mode 'abort' or 'keep', got {mode!r}; "
            "'wait' (drain the requests first) is the stepping loop's: LLM.sleep / "
            "LLM.pause_generation offline, the server's Sleep / PauseGeneration online"
        )
    return mode  # type: ignore[return-value]
