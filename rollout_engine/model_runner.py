"""Owns the device work: model, KV cache tensor, input preparation, forward and sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import AttentionMetadata
from rollout_engine.config import CacheConfig
from rollout_engine.models.decoder import DecoderForCausalLM, head_dim_of
from rollout_engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from rollout_engine.sampler import Sampler, SamplingRow, make_request_generator


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the KV cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model(cls, hf_config, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(
            hf_config.num_hidden_layers, block_size, hf_config.num_key_value_heads,
            head_dim_of(hf_config), dtype,
        )

    @property
    def block_nbytes(self) -> int:
        element_size = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    def num_blocks_for(self, cache_config: CacheConfig) -> int:
        if cache_config.num_blocks is not None:
            return cache_config.num_blocks
        return max(1, cache_config.kv_cache_bytes // self.block_nbytes)

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def storage_shape(self, num_blocks: int, heads_major: bool) -> tuple[int, ...]:
        """Memory order of the cache. Heads-major ([L, 2, Hkv, num_blocks, bs, D]) lets the
        CPU attention gather a batch's blocks straight into [Hkv, N, L, D] in one copy."""
        if not heads_major:
            return self.shape(num_blocks)
        return (self.num_layers, 2, self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    @staticmethod
    def logical_view(storage: torch.Tensor, heads_major: bool) -> torch.Tensor:
        """Always [L, 2, num_blocks, bs, Hkv, D] to the model and kernels, whatever the order."""
        return storage.permute(0, 1, 3, 4, 2, 5) if heads_major else storage


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
        self._generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self._generators.pop(request_id, None)
        scheduled = scheduler_output.scheduled_requests
        if not scheduled:
            return ModelRunnerOutput(sampled_token_ids={}, logprobs={})
        input_ids, positions, metadata = self._prepare_inputs(scheduled)
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
        return SamplingRow(
            params=params,
            generator=self._generator(req),
            token_history=history,
            draft_token_ids=drafts if req.num_spec_tokens else [],
        )

    def _generator(self, req: ScheduledRequest) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None or req.sampling_params.is_greedy:
            return None
        generator = self._generators.get(req.request_id)
        if generator is None:
            generator = make_request_generator(seed, req.sample_index)
            self._generators[req.request_id] = generator
        return generator
