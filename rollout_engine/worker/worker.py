"""One engine's device side: weights and KV cache in tagged pools, the model runner, updates."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kernels import kv_cache_layout
from memory import MemoryEventLog
from rollout_engine.config import EngineConfig
from rollout_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from rollout_engine.protocol import MemoryState, SleepLevel
from rollout_engine.worker.engine_memory import EngineMemory
from rollout_engine.worker.kv_cache_spec import KVCacheSpec
from rollout_engine.worker.model_runner import ModelRunner
from rollout_engine.worker.models.loader import (
    build_model,
    iterate_checkpoint,
    load_weights,
    parameter_nbytes,
    resolve_dtype,
)
from rollout_engine.worker.weight_update import WeightUpdater


class Worker:
    """Loads the model into the "weights" pool, sizes and allocates the KV cache in the
    "kv_cache" pool (in the layout the kernels want), and runs steps.

    `on_weight_update` is called after every completed weight update.
    """

    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        max_model_len: int,
        event_log: MemoryEventLog,
        on_weight_update: Callable[[], None],
    ) -> None:
        model_config, cache_config = config.model_config, config.cache_config
        self.device = torch.device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, hf_config, self.device)
        self.memory = EngineMemory(self.device, event_log)
        weights_pool = self.memory.create_weights_pool(parameter_nbytes(hf_config, self.dtype))
        model = build_model(
            hf_config, self.dtype, self.device, max_model_len, allocate=weights_pool.allocate
        )
        load_weights(model, iterate_checkpoint(model_config.model))
        self.weights = WeightUpdater(model, self.memory, event_log, on_weight_update)
        kv_spec = KVCacheSpec.from_model(hf_config, cache_config.block_size, self.dtype)
        self.num_blocks = kv_spec.num_blocks_for(cache_config)
        layout = kv_cache_layout(self.device)
        kv_storage = self.memory.allocate_kv_cache(
            kv_spec.storage_shape(layout, self.num_blocks), self.dtype
        )
        self.model_runner = ModelRunner(
            model, layout.logical_view(kv_storage), cache_config.block_size, model_config.seed
        )

    def check_ready(self) -> None:
        """EngineSleepingError saying what to call, unless weights and KV cache are ready."""
        self.memory.check_ready()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; refuses (EngineSleepingError) unless weights and KV are ready."""
        if not scheduler_output.is_empty:
            self.check_ready()  # never run the model on released or half-written memory
        return self.model_runner.execute(scheduler_output)

    # ------------------------------------------------------------------ memory
    def sleep(self, level: SleepLevel) -> None:
        self.weights.close_session("sleep() released the weights")
        self.memory.sleep(level)

    def wake_up(self, tags: Sequence[str]) -> None:
        self.memory.wake_up(tags)

    def release_kv_cache(self) -> None:
        self.memory.release_kv_cache()

    def memory_state(self) -> MemoryState:
        return self.memory.state()

    def kv_cache_ptr(self) -> int:
        """Address of the KV cache tensor the runner uses; stable across sleep and wake."""
        return self.model_runner.kv_caches.data_ptr()

    def weight_ptrs(self) -> dict[str, int]:
        """Address of every parameter the model uses; stable across sleep, wake and updates."""
        return {name: p.data_ptr() for name, p in self.model_runner.model.named_parameters()}
