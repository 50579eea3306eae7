"""Owns the device work: model, KV cache tensor, input preparation, forward and sampling."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels import cpu_extension
from kernels.dispatch import attention_backend
from rollout_engine.batch_invariant import set_batch_invariant_mode
from rollout_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from rollout_engine.protocol import StepFailedError
from rollout_engine.worker.cuda_graphs import DecodeGraphs
from rollout_engine.worker.fault_injection import FaultInjector
from rollout_engine.worker.kv_cache_spec import PagedKVCache
from rollout_engine.worker.lora.slots import LoRASlots
from rollout_engine.worker.models.packed_linear import PackedCopies
from rollout_engine.worker.persistent_batch import PersistentBatch, StepRequest
from rollout_engine.worker.routed_experts import RoutingStore
from rollout_engine.worker.sampling.prompt_logprobs import compute_prompt_logprobs
from rollout_engine.worker.sampling.sampler import Sampler
from rollout_engine.worker.staging import HostStaging
from rollout_engine.worker.step_inputs import StepInputs, build_step_inputs

if TYPE_CHECKING:
    from rollout_engine.worker.models.registry import CausalLM


@dataclass
class PreparedStep:
    """A step whose inputs are on the device, waiting for `ModelRunner.run`."""

    index: int
    """1, 2, ...: the order steps were prepared in (and must run in)."""
    scheduler_output: SchedulerOutput
    requests: list[StepRequest]
    """The step's requests as the worker holds them, in batch order."""
    inputs: StepInputs | None
    """None for an empty step."""
    token_bitmask: concurrent.futures.Future | None = None
    """Structured outputs: the step's grammar bitmask (numpy), computed on the host while the
    forward runs; sampling waits for it."""


class ModelRunner:
    """Turns a SchedulerOutput into sampled tokens."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: PagedKVCache,
        block_size: int,
        seed: int,
        decode_graphs: DecodeGraphs | None = None,
        is_driver: bool = True,
        packed_weights: PackedCopies | None = None,
        batch_invariant: bool = False,
        lora: LoRASlots | None = None,
        routed_experts: RoutingStore | None = None,
    ) -> None:
        self.model = model
        self.routed_experts = routed_experts
        """MoE routing recorded beside the KV after each forward."""
        self.lora = lora
        """With LoRA enabled: each step's tokens are grouped by adapter before its forward."""
        self.batch_invariant = batch_invariant
        """Steps run in `set_batch_invariant_mode()` (`ModelConfig.batch_invariant`)."""
        self.packed_weights = packed_weights
        """CPU: the linears' oneDNN copies, packed again before a forward when dropped."""
        self.is_driver = is_driver
        """False on tensor-parallel ranks other than 0: they run the forward and the logits'
        all-gather, and leave sampling to rank 0."""
        self.kv_caches = kv_caches  # per layer (key_cache, value_cache)
        self.block_size = block_size
        self.device = kv_caches.device
        self.vocab_size = model.config.vocab_size
        self.sampler = Sampler(seed=seed)
        self.staging = HostStaging(self.device)
        self.batch = PersistentBatch()
        """Every request this runner holds, kept from the scheduler's deltas."""
        self.attention_backend = attention_backend(self.device)
        if self.attention_backend == "cpu":
            cpu_extension.available()  # build or load the CPU kernel now, not in the first step
        self.decode_graphs = decode_graphs
        """Plain decode steps replay CUDA graphs when set (`ModelConfig.cuda_graphs`)."""
        # Async scheduling: the sampled tokens of the last step run, for placeholders.
        self._num_prepared = 0
        self._num_run = 0
        self._previous_step: StepInputs | None = None
        self._last_sampled: torch.Tensor | None = None
        self.fault_injector: FaultInjector | None = None
        self._fault_hook: torch.utils.hooks.RemovableHandle | None = None
        self.set_fault_injector(FaultInjector.from_env())

    def set_fault_injector(self, injector: FaultInjector | None) -> None:
        """Test-only: make chosen steps' forward raise (None turns it off)."""
        if self._fault_hook is not None:
            self._fault_hook.remove()
            self._fault_hook = None
        self.fault_injector = injector
        if injector is not None:
            self._fault_hook = injector.install(self.model)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Prepare and run one step."""
        return self.run(self.prepare(scheduler_output))

    def prepare(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """Host work of a step: its inputs, built and sent to the device. Steps must be
        prepared in the order they were scheduled, and run in that order."""
        self._num_prepared += 1
        requests = self.batch.update(scheduler_output)
        step = None
        if requests:
            step = build_step_inputs(
                requests, self.block_size, self.vocab_size, self.sampler, self.staging,
                self.batch, host_block_tables=self.attention_backend == "cpu",
                previous_step=self._previous_step,
            )
            self._previous_step = step
        return PreparedStep(self._num_prepared, scheduler_output, requests, step)

    def drop_requests(self, scheduler_output: SchedulerOutput) -> None:
        """An empty step that tells of finished or preempted requests: forget them (nothing
        runs, so it is not a prepared step)."""
        self.batch.forget_dropped(scheduler_output)

    @torch.inference_mode()
    def run(self, prepared: PreparedStep) -> ModelRunnerOutput:
        """Device work of a step: forward, logits, sampling; then its one host sync.

        Under async scheduling this runs while the next step is prepared on another thread
        (on a GPU, this one is the engine's forward thread; on the CPU, the caller's). A step
        with placeholders reads the tokens of the step prepared just before it, which must
        have run and succeeded. With `batch_invariant`, all of it in that mode.
        """
        # The engine's weights change only through the worker, which drops the packed copies.
        with set_batch_invariant_mode(self.batch_invariant, reuse_packed_weights=True):
            return self._run(prepared)

    def _run(self, prepared: PreparedStep) -> ModelRunnerOutput:
        step = prepared.inputs
        tokens_of_previous_step = self._last_sampled if self._num_run == prepared.index - 1 else None
        self._num_run, self._last_sampled = prepared.index, None
        if step is None:
            return ModelRunnerOutput(sampled_token_ids={}, logprobs={})
        if step.patch_positions is not None:
            if tokens_of_previous_step is None:
                raise StepFailedError(
                    "a step reads tokens of a previous step that did not complete"
                )
            step.input_ids.index_copy_(
                0, step.patch_positions, tokens_of_previous_step.index_select(0, step.patch_rows)
            )
        if self.packed_weights is not None:
            self.packed_weights.ensure()
        if self.fault_injector is not None:
            self.fault_injector.arm(prepared.requests)
        if self._use_graphs(step):
            hidden = self.decode_graphs.run(step.input_ids, step.positions, step.metadata)
        elif self.lora is not None:
            hidden = self._forward_with_lora(prepared.requests, step)
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.metadata)
        if self.routed_experts is not None:
            self.routed_experts.store_step(step.metadata.slot_mapping)
        prompt_logprobs = {}
        if step.prompt_logprobs_jobs:  # every rank: the logits are gathered across ranks
            prompt_logprobs = compute_prompt_logprobs(
                self.model.compute_logits, hidden, step.prompt_logprobs_jobs, self.vocab_size
            )
        if not step.sampled_request_ids:
            return ModelRunnerOutput(sampled_token_ids={}, logprobs={},
                                     prompt_logprobs=prompt_logprobs)
        if step.logits_rows.shape[0] != hidden.shape[0]:
            hidden = hidden.index_select(0, step.logits_rows)
        logits = self.model.compute_logits(hidden)  # [P, vocab] float32
        if not self.is_driver:
            return ModelRunnerOutput(sampled_token_ids={}, logprobs={})
        plan = step.sampling_plan
        bitmask = None
        if prepared.token_bitmask is not None:
            bitmask = torch.from_numpy(prepared.token_bitmask.result()).to(self.device)
        token_ids, logprobs = self.sampler.sample_positions(
            logits, plan, step.sampling_tensors, bitmask
        )
        results = self.sampler.to_results(token_ids, logprobs, plan)
        self._last_sampled = token_ids
        request_ids = step.sampled_request_ids
        return ModelRunnerOutput(
            sampled_token_ids={rid: res.token_ids for rid, res in zip(request_ids, results)},
            logprobs={rid: res.logprobs for rid, res in zip(request_ids, results)},
            top_logprobs={rid: res.top_logprobs for rid, res in zip(request_ids, results)
                          if res.top_logprobs is not None},
            sampling_masks={rid: res.sampling_masks for rid, res in zip(request_ids, results)
                            if res.sampling_masks is not None},
            prompt_logprobs=prompt_logprobs,
        )

    def _forward_with_lora(self, requests: list[StepRequest], step: StepInputs) -> torch.Tensor:
        """The forward with the step's tokens grouped by the adapter their request runs under
        (rows in request order, as `build_step_inputs` lays them out)."""
        runs, row = [], 0
        for request in requests:
            num_rows = len(request.input_token_ids)
            if request.lora_id:
                runs.append((request.lora_id, row, row + num_rows))
            row += num_rows
        self.lora.begin_step(runs, row)
        try:
            return self.model(step.input_ids, step.positions, self.kv_caches, step.metadata)
        finally:
            self.lora.end_step()

    def _use_graphs(self, step: StepInputs) -> bool:
        graphs = self.decode_graphs
        return (
            graphs is not None
            and self.fault_injector is None  # its hooks need the eager forward
            and step.is_uniform_decode
            and graphs.can_run(step.metadata.num_reqs, step.metadata.block_tables.shape[1])
        )

    def refresh_graphs(self) -> None:
        """After memory was remapped or weights replaced: drop graphs that would read from
        old addresses (they are captured again when next needed)."""
        if self.decode_graphs is not None and not self.decode_graphs.addresses_unchanged():
            self.decode_graphs.reset()
