"""Owns the device work: model, KV cache tensor, input preparation, forward and sampling."""

from __future__ import annotations

import torch

from kernels import AttentionMetadata
from rollout_engine.core.scheduler_output import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from rollout_engine.worker.fault_injection import FaultInjector
from rollout_engine.worker.models.decoder import DecoderForCausalLM
from rollout_engine.worker.sampler import Sampler, SamplingRow, request_stream_seed


class ModelRunner:
    """Turns a SchedulerOutput into sampled tokens."""

    def __init__(
        self, model: DecoderForCausalLM, kv_caches: torch.Tensor, block_size: int, seed: int
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches  # [L, 2, num_blocks, block_size, Hkv, D]
        self.block_size = block_size
        self.device = kv_caches.device
        self.sampler = Sampler(seed=seed)
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

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        scheduled = scheduler_output.scheduled_requests
        if not scheduled:
            return ModelRunnerOutput(sampled_token_ids={}, logprobs={})
        input_ids, positions, metadata = self._prepare_inputs(scheduled)
        if self.fault_injector is not None:
            self.fault_injector.arm(scheduler_output)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)  # [T, hidden]
        sample_rows, sampling_rows, sampled_reqs = self._prepare_sampling(scheduled)
        if not sampled_reqs:
            return ModelRunnerOutput(sampled_token_ids={}, logprobs={})
        logits = self.model.compute_logits(hidden[sample_rows])  # [R, vocab] float32
        results = self.sampler(logits, sampling_rows)
        return ModelRunnerOutput(
            sampled_token_ids={r.request_id: res.token_ids for r, res in zip(sampled_reqs, results)},
            logprobs={r.request_id: res.logprobs for r, res in zip(sampled_reqs, results)},
        )

    def _prepare_inputs(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        for req in scheduled:
            input_ids.extend(req.input_token_ids)
            positions.extend(range(req.start_position, req.start_position + len(req.input_token_ids)))
        metadata = AttentionMetadata.build(
            query_lens=[len(r.input_token_ids) for r in scheduled],
            seq_lens=[r.start_position + len(r.input_token_ids) for r in scheduled],
            block_tables=[r.block_ids for r in scheduled],
            block_size=self.block_size,
            device=self.device,
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            metadata,
        )

    def _prepare_sampling(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, list[SamplingRow], list[ScheduledRequest]]:
        """Rows of the flat batch to sample: the last committed token and each draft."""
        rows: list[int] = []
        sampling_rows: list[SamplingRow] = []
        sampled_reqs: list[ScheduledRequest] = []
        end = 0
        for req in scheduled:
            end += len(req.input_token_ids)
            if not req.needs_sample:
                continue
            rows.extend(range(end - req.num_spec_tokens - 1, end))
            sampled_reqs.append(req)
            sampling_rows.append(self._sampling_row(req))
        return torch.tensor(rows, dtype=torch.int64, device=self.device), sampling_rows, sampled_reqs

    def _sampling_row(self, req: ScheduledRequest) -> SamplingRow:
        params = req.sampling_params
        history: list[int] = []
        if params.repetition_penalty != 1.0:
            history = req.prompt_token_ids + req.output_token_ids
        drafts = req.input_token_ids[len(req.input_token_ids) - req.num_spec_tokens :]
        seed = params.seed
        return SamplingRow(
            params=params,
            stream_seed=None if seed is None else request_stream_seed(seed, req.sample_index),
            token_history=history,
            draft_token_ids=drafts if req.num_spec_tokens else [],
            first_output_index=req.num_output_tokens,
        )
