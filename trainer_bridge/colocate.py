"""The colocate choreography for a hand-written RL loop: rollout() and training() phases.

    colocation = Colocation(client, sleep_level=2, timeline=MemoryTimeline(pids).start())
    for step in range(num_steps):
        with colocation.rollout(weights=model) as engine:  # wake weights, push, wake KV
            outputs = engine.generate(prompts, params)
        # leaving rollout(): engine.sleep(2) hands weights and KV memory back
        with colocation.training():
            loss = ...; loss.backward(); optimizer.step()
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Literal

import torch

from rollout_engine.protocol import (
    KV_CACHE_TAG,
    WEIGHTS_TAG,
    EngineError,
    LoadedLoRA,
    SleepLevel,
    SleepMode,
    check_sleep_mode,
)
from trainer_bridge.lora_sync import PolicyAdapter
from trainer_bridge.partial_rollouts import PartialRollouts
from trainer_bridge.timeline import MemoryTimeline
from trainer_bridge.transports import ManifestMismatchError, WeightManifest

if TYPE_CHECKING:
    from trainer_bridge.client import EngineClient


class StreamedWeights:
    """Weights made afresh by `iterate()` at every sync and read once, as they are made.

    Each tensor is copied into a transport bucket when it is yielded, so an iterator that
    gathers sharded parameters or merges LoRA adapters while it runs (see
    `trainer_weights.iter_policy_weights`) sends what it yields, and the sync holds only the
    buckets beyond the model. The manifest (names, shapes, dtypes) is read by one pass the
    first time and kept; when the tensors stop matching it, it is read again.
    """

    def __init__(self, iterate: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> None:
        self.iterate = iterate
        self._manifest: WeightManifest | None = None

    def manifest(self) -> WeightManifest:
        if self._manifest is None:
            self._manifest = WeightManifest.of(self.iterate())
        return self._manifest

    def forget_manifest(self) -> None:
        self._manifest = None


Weights = (
    torch.nn.Module
    | Mapping[str, torch.Tensor]
    | Iterable[tuple[str, torch.Tensor]]
    | StreamedWeights
)


def release_trainer_cache() -> None:
    """Hand memory the trainer freed back to the OS / driver before the engine takes memory.

    On CUDA that is the caching allocator (`empty_cache`, as TRL does before waking vLLM); on
    CPU it is glibc's heap, which keeps freed blocks resident until `malloc_trim`."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()


class Colocation:
    """Drives one engine through generate -> sleep -> (train) -> wake weights -> push weights
    -> reset prefix cache -> wake KV, recording each step as a phase of `timeline`.

    `sleep_level` 2 discards weights and KV while the trainer trains (weights must be pushed
    before the next rollout), 1 offloads weights to host memory and discards KV, None never
    sleeps (the baseline the other two are measured against). `sleep_mode` says what becomes
    of requests in flight at the sleep; with "keep" they survive it and the weight push (a
    push to an awake engine pauses them around it), which `partial_rollouts` relies on.
    """

    def __init__(
        self,
        client: EngineClient,
        *,
        sleep_level: SleepLevel | int | None = SleepLevel.DISCARD_ALL,
        sleep_mode: SleepMode = "abort",
        timeline: MemoryTimeline | None = None,
        transport: str = "auto",
        weight_dtype: torch.dtype | Literal["engine"] | None = None,
    ) -> None:
        self.sleep_level = None if sleep_level is None else SleepLevel.parse(sleep_level)
        self.sleep_mode = check_sleep_mode(sleep_mode)
        self.timeline = timeline
        self.transport = transport
        if not (weight_dtype is None or weight_dtype == "engine"
                or isinstance(weight_dtype, torch.dtype)):
            raise ValueError(f"weight_dtype must be None, 'engine' or a torch.dtype, "
                             f"got {weight_dtype!r}")
        self.weight_dtype = weight_dtype
        """Cast pushed tensors to this dtype as they are sent ("engine": the engine's dtype);
        None sends them as they are, and the engine refuses a dtype other than its own."""
        self.num_weight_pushes = 0
        self.num_adapter_pushes = 0
        self.weight_version = 0
        self.adapter: LoadedLoRA | None = None
        """LoRA policies (`sync_adapter`): the adapter the engine serves the policy as."""
        self.attach(client)

    def attach(self, client: EngineClient) -> None:
        """Drive `client`'s engine from now on, e.g. a restarted one. Its weights are taken as
        stale: the next rollout pushes the trainer's weights before generating."""
        self.client = client
        state = client.memory_state()
        self.is_weights_awake = state.tags[WEIGHTS_TAG].state == "awake"
        self.is_kv_awake = state.tags[KV_CACHE_TAG].state == "awake"
        self.is_weights_discarded = not state.weights_valid
        self.needs_weights = True
        """The engine does not hold the trainer's current weights (as far as we know)."""
        self._engine_dtype: torch.dtype | None = None

    # ------------------------------------------------------------------------------ phases
    @contextlib.contextmanager
    def rollout(self, weights: Weights | None = None) -> Iterator[EngineClient]:
        """Make the engine ready (weights pushed when given, KV awake), yield its client for
        generation, then put it to sleep. Without `weights` the engine generates with what it
        holds (after a level-1 sleep: the weights it had); after a level-2 sleep, which
        discards them, weights must be given."""
        client = self.prepare_rollout(weights)
        with self._phase("generate"):
            try:
                yield client
            except EngineError:
                raise  # the engine failed: a sleep call would fail (or hang) the same way
            except BaseException:
                self.sleep()
                raise
        self.sleep()

    def prepare_rollout(self, weights: Weights | None = None) -> EngineClient:
        """`rollout()`'s first half, for rollouts of several calls (turns): the engine stays
        awake until `sleep()`. Weights are pushed only when given."""
        self.end_training()
        if weights is not None:
            self.sync_weights(weights)
        elif self.is_weights_discarded:
            raise ValueError("sleep(level=2) discarded the engine's weights: pass "
                             "rollout(weights=model) to push them before generating")
        elif not self.is_weights_awake:
            release_trainer_cache()
            self._verb("wake_weights", self.client.wake_up, [WEIGHTS_TAG])
            self.is_weights_awake = True
        self.wake_kv_cache()
        return self.client

    def generate_phase(self) -> contextlib.AbstractContextManager:
        """Marks one generation call (one turn) as a "generate" phase of the timeline."""
        return self._phase("generate")

    @property
    def is_awake(self) -> bool:
        return self.is_weights_awake or self.is_kv_awake

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Mark the trainer's forward / backward / optimizer work as the "train" phase."""
        self.begin_training()
        try:
            yield
        finally:
            self.end_training()

    def begin_training(self) -> None:
        """Open the "train" phase; the next engine call (or `end_training`) closes it."""
        if self.timeline is not None:
            self.timeline.end("train")
            self.timeline.begin("train")

    def end_training(self) -> None:
        if self.timeline is not None:
            self.timeline.end("train")

    # ------------------------------------------------------------------------------- verbs
    def sync_weights(self, weights: Weights) -> int:
        """Wake the weights, push `weights` (Hugging Face names), reset the prefix cache;
        returns the engine's new weight version."""
        self.end_training()
        release_trainer_cache()
        if not self.is_weights_awake:
            self._verb("wake_weights", self.client.wake_up, [WEIGHTS_TAG])
            self.is_weights_awake = True
        with self._phase("weight_sync"):
            if self.sleep_mode == "keep" and self.is_kv_awake:
                # Requests may be in flight (never slept, or several calls per rollout): they
                # are frozen for the push and go on with the new weights.
                self.client.pause_generation("keep")
                try:
                    self.weight_version = self._push(weights)
                finally:
                    self.client.resume_generation()
            else:
                self.weight_version = self._push(weights)
        self.num_weight_pushes += 1
        self._verb("reset_prefix_cache", self.client.reset_prefix_cache)
        self.needs_weights = self.is_weights_discarded = False
        return self.weight_version

    def sync_adapter(self, policy: PolicyAdapter) -> LoadedLoRA:
        """A LoRA policy served unmerged: push only its adapter (loaded in place under
        `policy.lora_name`: requests running under the previous version finish under it, and
        no prefix-cache entry of another version is served), and the base weights only when
        the engine may not hold them (the first sync, or after a level-2 sleep)."""
        if self.needs_weights or self.is_weights_discarded:
            if not policy.push_base and self.is_weights_discarded:
                raise ValueError("the engine's base weights were discarded (sleep level 2) and "
                                 "this policy does not push its base: sleep at level 1")
            if policy.push_base:
                self.sync_weights(StreamedWeights(policy.base_weights))
        self.end_training()
        release_trainer_cache()
        if not self.is_weights_awake:
            self._verb("wake_weights", self.client.wake_up, [WEIGHTS_TAG])
            self.is_weights_awake = True
        dtype = self._engine_weight_dtype() if self.weight_dtype == "engine" else self.weight_dtype
        with self._phase("weight_sync"):
            self.adapter = self.client.load_lora_adapter(
                policy.lora_name, policy.adapter(), policy.peft_config, load_inplace=True,
                transport=self.transport, dtype=dtype)
        self.num_adapter_pushes += 1
        self.needs_weights = False
        return self.adapter

    def partial_rollouts(self, prompts: Iterator, sampling_params, *, oversample: float = 2.0,
                         max_staleness: int | None = None) -> PartialRollouts:
        """`PartialRollouts` on this engine: more groups in flight than a step needs, the
        unfinished ones kept through the training phase (needs `sleep_mode="keep"`)."""
        if self.sleep_mode != "keep":
            raise ValueError(
                f"partial rollouts keep groups in flight through the training phase, which "
                f"sleep_mode={self.sleep_mode!r} would end: build the Colocation with "
                f"sleep_mode='keep'")
        return PartialRollouts(self.client, prompts, sampling_params, oversample=oversample,
                               max_staleness=max_staleness)

    def wake_kv_cache(self) -> None:
        if not self.is_kv_awake:
            self._verb("wake_kv_cache", self.client.wake_up, [KV_CACHE_TAG])
            self.is_kv_awake = True
            self._record_pools("after_wake")

    def sleep(self) -> None:
        """Sleep at `sleep_level` (nothing when it is None or the engine already sleeps)."""
        if self.sleep_level is None or not self.is_awake:
            return
        self._record_pools("before_sleep")
        self._verb("sleep", self.client.sleep, self.sleep_level, self.sleep_mode)
        self._record_pools("after_sleep")
        self.is_kv_awake = False
        self.is_weights_awake = False
        if self.sleep_level == SleepLevel.DISCARD_ALL:
            self.needs_weights = self.is_weights_discarded = True

    # --------------------------------------------------------------------------- internals
    def _record_pools(self, label: str) -> None:
        """The engine's mapped pool bytes, on the timeline (one memory_state call)."""
        if self.timeline is None:
            return
        state = self.client.memory_state()
        self.timeline.record_pools(
            label, {tag: t.num_bytes if t.mapped else 0 for tag, t in state.tags.items()}
        )

    def _verb(self, phase: str, method, *args, **kwargs):
        with self._phase(phase):
            return method(*args, **kwargs)

    def _phase(self, name: str) -> contextlib.AbstractContextManager:
        return self.timeline.phase(name) if self.timeline is not None else contextlib.nullcontext()

    def _push(self, weights: Weights) -> int:
        dtype = self._engine_weight_dtype() if self.weight_dtype == "engine" else self.weight_dtype
        if not isinstance(weights, StreamedWeights):
            return self.client.update_weights(weights, transport=self.transport, dtype=dtype)

        def stream() -> int:
            return self.client.update_weights(
                weights.iterate(), transport=self.transport, dtype=dtype,
                manifest=weights.manifest(),
            )

        try:
            return stream()
        except ManifestMismatchError:  # the model changed shape or names since the last sync
            weights.forget_manifest()
            return stream()

    def _engine_weight_dtype(self) -> torch.dtype:
        if self._engine_dtype is None:
            name = self.client.info().dtype
            self._engine_dtype = getattr(torch, name)
        return self._engine_dtype
