"""One engine's device side: weights and KV cache in tagged pools, the model runner, updates."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kernels import cpu_extension, kv_cache_layout
from kernels.triton_utils import batch_invariant_runs_triton
from memory import MemoryEventLog
from memory.pool import ALIGNMENT_BYTES
from rollout_engine.batch_invariant import drop_packed_weights
from rollout_engine.config import EngineConfig
from rollout_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from rollout_engine.protocol import LoRAError, MemoryState, SleepLevel
from rollout_engine.worker.cuda_graphs import DecodeGraphs
from rollout_engine.worker.engine_memory import EngineMemory
from rollout_engine.worker.kv_cache_spec import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    PagedKVCache,
    activation_bytes_estimate,
    plan_kv_cache_bytes,
)
from rollout_engine.worker.lora.adapter import LoRAWeights, build_lora_weights
from rollout_engine.worker.lora.slots import LoRASlots
from rollout_engine.worker.model_runner import ModelRunner, PreparedStep
from rollout_engine.worker.models.packed_linear import PackedCopies, can_pack
from rollout_engine.worker.models.registry import CausalLM, resolve_model_backend
from rollout_engine.worker.routed_experts import RoutingStore
from rollout_engine.worker.tp.tp_group import TPGroup
from rollout_engine.worker.weights.loader import resolve_dtype
from rollout_engine.worker.weights.weight_update import WeightUpdater


class Worker:
    """Loads the model into the "weights" pool, sizes and allocates the KV cache in the
    "kv_cache" pool (in the layout the kernels want), and runs steps.

    `on_weight_update` is called after every completed weight update. Under tensor
    parallelism each rank has a Worker of its own holding its shard (`tp`); only rank 0's
    samples.
    """

    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        max_model_len: int,
        event_log: MemoryEventLog,
        on_weight_update: Callable[[], None],
        tp: TPGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        model_config = config.model_config
        self.tp = tp or TPGroup()
        self.model_backend = resolve_model_backend(config, hf_config)
        """The modeling code that runs the model, as the model registry picked it."""
        self.device = device or torch.device(model_config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # this thread's kernels go to the engine's GPU
        self.dtype = resolve_dtype(model_config.dtype, hf_config, self.device)
        self.memory = EngineMemory(self.device, event_log)
        model, weights_bytes = self.model_backend.load(
            model_config.model, self.dtype, self.device, max_model_len,
            self.memory.create_weights_pool, self.tp,
        )
        self.batch_invariant = model_config.batch_invariant
        self._init_lora(config, model)
        self._init_packed_weights(model, model_config.cpu_packed_weights)
        self.weights = WeightUpdater(model, self.memory, event_log,
                                     self._after_weight_update(on_weight_update))
        kv_caches = self._init_kv_cache(config, model, hf_config, weights_bytes)
        self._init_model_runner(config, model, kv_caches, max_model_len)

    @property
    def model_impl(self) -> str:
        """The name of the modeling code that runs the model (`ModelConfig.model_impl`)."""
        return self.model_backend.name

    def _init_lora(self, config: EngineConfig, model: CausalLM) -> None:
        self.lora: LoRASlots | None = None
        """With `enable_lora`: the adapters and their device slots (`worker/lora/slots.py`)."""
        lora_config = config.lora_config
        if lora_config.enable_lora:
            self.lora = LoRASlots(lora_config.max_loras, self.device)
            self.max_lora_rank = lora_config.max_lora_rank
            model.attach_lora(self.lora, lora_config.max_lora_rank, self.dtype)
            slack = ALIGNMENT_BYTES * (1 + sum(len(p.tensors) for p in self.lora.points))
            pool = self.memory.create_lora_pool(self.lora.num_bytes + slack)
            self.lora.move_into(pool.allocate)

    def add_lora(self, adapter_id: int, peft_config: Mapping[str, Any],
                 tensors: Mapping[str, torch.Tensor]) -> LoRAWeights:
        """Check an adapter against the model and register it under `adapter_id` (its device
        slot is filled when a step first runs it). LoRAError, registering nothing, if refused."""
        if self.lora is None:
            raise LoRAError("LoRA is not enabled on this engine (enable_lora=True)")
        weights = self.check_lora(peft_config, tensors)
        self.lora.register(adapter_id, weights)
        return weights

    def check_lora(self, peft_config: Mapping[str, Any],
                   tensors: Mapping[str, torch.Tensor]) -> LoRAWeights:
        """An adapter's deltas, checked against the model (meta tensors: checked only)."""
        if self.lora is None:
            raise LoRAError("LoRA is not enabled on this engine (enable_lora=True)")
        return build_lora_weights(peft_config, tensors, self.lora.linears, self.max_lora_rank,
                                  self.dtype, experts=self.lora.experts)

    def remove_lora(self, adapter_id: int) -> None:
        if self.lora is not None:
            self.lora.unregister(adapter_id)

    def _init_packed_weights(self, model: CausalLM, cpu_packed_weights: bool) -> None:
        self.packed_weights: PackedCopies | None = None
        """CPU: the linears' oneDNN copies (`packed_linear.py`), when the CPU packs them; under
        batch invariance, the batch-invariant GEMM's (where the CPU kernels, not the Triton ones
        in their interpreter, run the mode)."""
        if not cpu_packed_weights:
            return
        if self.batch_invariant:
            if (self.device.type == "cpu" and cpu_extension.available()
                    and not batch_invariant_runs_triton(torch.empty(0, device=self.device))):
                self.packed_weights = self.model_backend.invariant_packed_linears(model)
        elif can_pack(self.device, self.dtype):
            self.packed_weights = self.model_backend.packed_linears(model)

    def _after_weight_update(self, on_weight_update: Callable[[], None]) -> Callable[[], None]:
        def after_update() -> None:
            on_weight_update()
            if self.packed_weights is not None:
                self.packed_weights.drop()  # packed again from the new weights
            if self.batch_invariant:
                drop_packed_weights()  # the batch-invariant kernel's copies, likewise
            self.model_runner.refresh_graphs()
            self._return_cached_device_memory()  # the update's staging copies

        return after_update

    def _init_kv_cache(
        self, config: EngineConfig, model: CausalLM, hf_config, weights_bytes: int
    ) -> PagedKVCache:
        """Size the KV cache (`num_blocks`) and allocate it in the "kv_cache" pool."""
        cache_config = config.cache_config
        kv_spec = self.kv_spec = self.model_backend.kv_cache_spec(
            model, cache_config.block_size, self.dtype
        )
        self.num_blocks = kv_spec.num_blocks_for(
            cache_config, self._kv_cache_bytes(config, hf_config, weights_bytes)
        )
        # CUDA graphs pad batches; padding rows write to one block outside the pool.
        num_cache_blocks = self.num_blocks + (1 if config.model_config.cuda_graphs else 0)
        kv_storage = self.memory.allocate_kv_cache(
            (kv_spec.num_elements(num_cache_blocks),), self.dtype
        )
        return PagedKVCache(kv_storage, kv_spec, kv_cache_layout(self.device), num_cache_blocks)

    def _init_model_runner(
        self, config: EngineConfig, model: CausalLM, kv_caches: PagedKVCache, max_model_len: int
    ) -> None:
        model_config, block_size = config.model_config, config.cache_config.block_size
        decode_graphs = None
        if model_config.cuda_graphs:
            decode_graphs = DecodeGraphs(
                model, kv_caches, block_size,
                max_batch_size=config.scheduler_config.max_num_seqs,
                max_blocks_per_seq=-(-max_model_len // block_size),
                max_model_len=max_model_len,
                scratch_block=self.num_blocks,
            )
        self.routed_experts = None
        """MoE routing beside the KV (`enable_return_routed_experts`)."""
        if model_config.enable_return_routed_experts:
            if decode_graphs is not None or config.kv_transfer_config.kv_role is not None:
                raise ValueError("enable_return_routed_experts does not work with cuda_graphs "
                                 "(a replayed graph runs no router hook) or KV transfers (KV "
                                 "that arrives has no routing) yet; turn one off")
            self.routed_experts = RoutingStore(model, kv_caches.num_blocks * block_size,
                                                block_size)
        self.model_runner = ModelRunner(
            model, kv_caches, block_size, model_config.seed, decode_graphs,
            is_driver=self.tp.is_driver, packed_weights=self.packed_weights,
            batch_invariant=model_config.batch_invariant, lora=self.lora,
            routed_experts=self.routed_experts,
        )

    def set_eos_token_ids(self, eos_token_ids: Sequence[int]) -> None:
        """The model's EOS ids (the engine reads them with the tokenizer): `min_tokens` masks
        them while sampling."""
        self.model_runner.sampler.eos_token_ids = tuple(eos_token_ids)

    @property
    def is_ready(self) -> bool:
        """Weights awake and valid and KV cache mapped (see `check_ready`)."""
        return self.memory.is_ready

    def check_ready(self) -> None:
        """EngineSleepingError saying what to call, unless weights and KV cache are ready."""
        self.memory.check_ready()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; refuses (EngineSleepingError) unless weights and KV are ready."""
        return self.run_model(self.prepare_model_input(scheduler_output))

    def prepare_model_input(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """The host half of a step (see `ModelRunner.prepare`)."""
        if not scheduler_output.is_empty:
            self.check_ready()  # never run the model on released or half-written memory
        return self.model_runner.prepare(scheduler_output)

    def run_model(self, prepared: PreparedStep) -> ModelRunnerOutput:
        """The device half of a step; may run on another thread than the host half."""
        return self.model_runner.run(prepared)

    def drop_requests(self, scheduler_output: SchedulerOutput) -> None:
        """An empty step's news of finished or preempted requests (`ModelRunner.drop_requests`)."""
        self.model_runner.drop_requests(scheduler_output)

    def _kv_cache_bytes(self, config: EngineConfig, hf_config, weights_bytes: int) -> int:
        cache_config, scheduler_config = config.cache_config, config.scheduler_config
        if cache_config.kv_cache_bytes is not None:
            return cache_config.kv_cache_bytes
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        activation_bytes = activation_bytes_estimate(
            hf_config, scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs,
            self.dtype,
        )
        return plan_kv_cache_bytes(total_bytes, free_bytes, weights_bytes, activation_bytes,
                                   cache_config.gpu_memory_utilization)

    def shutdown(self) -> None:
        """Free the weights and KV pools for good (tensor parallelism's rank 0 also stops
        the other ranks here); the worker cannot run afterwards."""
        self.memory.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the activations' cached blocks, too

    # ------------------------------------------------------------------ memory
    def sleep(self, level: SleepLevel) -> None:
        self.weights.close_session("sleep() released the weights")
        if self.packed_weights is not None and level == 2:
            # The weights are discarded: so are their copies (packed again by the first
            # forward after the update). Level 1 restores the weights as they were, and on
            # the CPU their backup stays in host memory as the copies do: they are kept.
            self.packed_weights.drop()
        if self.batch_invariant:
            drop_packed_weights()  # packed again by the first step after waking
        self.memory.sleep(level)
        if self.lora is not None:
            self.lora.forget_slots()  # their pool is released
        self._return_cached_device_memory()

    def wake_up(self, tags: Sequence[str]) -> None:
        self.memory.wake_up(tags)
        self.model_runner.refresh_graphs()

    def release_kv_cache(self) -> None:
        self.memory.release_kv_cache()
        self._return_cached_device_memory()

    def _return_cached_device_memory(self) -> None:
        """Hand blocks PyTorch's caching allocator holds (activations, staging copies) back
        to the driver, so the trainer gets all that the engine freed, not just the pools."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def memory_state(self) -> MemoryState:
        return self.memory.state()

    def kv_cache_ptr(self) -> int:
        """Address of the KV cache tensor the runner uses; stable across sleep and wake."""
        return self.model_runner.kv_caches.data_ptr()

    def weight_ptrs(self) -> dict[str, int]:
        """Address of every parameter the model uses; stable across sleep, wake and updates."""
        return {name: p.data_ptr() for name, p in self.model_runner.model.named_parameters()}

