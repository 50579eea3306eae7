"""Wires tokenizer, scheduler and model runner; adds, aborts and steps requests."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import torch

from rollout_engine.config import EngineConfig, RuntimeLimits
from rollout_engine.errors import InvalidRequestError
from rollout_engine.model_runner import KVCacheSpec, ModelRunner
from rollout_engine.models.loader import (
    build_model, iterate_checkpoint, load_hf_config, load_weights, resolve_dtype,
)
from rollout_engine.outputs import CompletionOutput, RequestOutput
from rollout_engine.request import Request
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler import Scheduler


@dataclass
class _Group:
    """The `n` sampled requests of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request] = field(default_factory=list)


class LLMEngine:
    """One model, one scheduler, one runner. `step()` advances every running request once."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_config = config.model_config
        self.hf_config = load_hf_config(model_config.model)
        self.device = torch.device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.hf_config, self.device)
        self.tokenizer = _load_tokenizer(model_config.model)
        max_position_embeddings = self.hf_config.max_position_embeddings
        max_model_len = config.scheduler_config.max_model_len or max_position_embeddings
        if max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{max_position_embeddings}"
            )
        model = build_model(self.hf_config, self.dtype, self.device, max_model_len)
        load_weights(model, iterate_checkpoint(model_config.model))
        self.kv_spec = KVCacheSpec.from_model(
            self.hf_config, config.cache_config.block_size, self.dtype
        )
        num_blocks = self.kv_spec.num_blocks_for(config.cache_config)
        kv_caches = torch.zeros(self.kv_spec.shape(num_blocks), dtype=self.dtype, device=self.device)
        self.model_runner = ModelRunner(
            model, kv_caches, config.cache_config.block_size, model_config.seed
        )
        self.limits = RuntimeLimits(
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            vocab_size=self.hf_config.vocab_size,
            eos_token_ids=_eos_token_ids(model_config.model, self.hf_config, self.tokenizer),
        )
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, config.speculative_config, self.limits
        )
        self.weight_version = 0
        self._groups: dict[str, _Group] = {}
        self._aborted_group_ids: set[str] = set()
        self._arrivals = itertools.count()

    # ------------------------------------------------------------------ requests
    def add_request(
        self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams
    ) -> None:
        """Queue `sampling_params.n` completions of one prompt; bad input raises at once."""
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not isinstance(sampling_params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams")
        text, token_ids = self._tokenize(prompt)
        group = _Group(request_id, text, token_ids)
        arrival = next(self._arrivals)
        for j in range(sampling_params.n):
            child = Request(
                f"{request_id}/{j}", token_ids, sampling_params,
                group_id=request_id, sample_index=j, arrival_index=arrival,
            )
            try:
                self.scheduler.add_request(child)
            except Exception:
                self.scheduler.finish_requests([c.request_id for c in group.children])
                raise
            group.children.append(child)
        self._groups[request_id] = group

    def abort_request(self, request_ids: str | list[str]) -> None:
        """End requests now; their outputs come back from the next `step()` as "abort"."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            group = self._groups.get(request_id)
            if group is None:
                continue
            self.scheduler.finish_requests([c.request_id for c in group.children], "abort")
            self._aborted_group_ids.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, commit tokens; outputs of prompts that progressed."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute(scheduler_output)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        group_ids = dict.fromkeys(r.group_id for r in updated)
        group_ids.update(dict.fromkeys(self._aborted_group_ids))
        self._aborted_group_ids.clear()
        return [self._make_output(gid) for gid in group_ids if gid in self._groups]

    def _make_output(self, group_id: str) -> RequestOutput:
        group = self._groups[group_id]
        outputs = [self._completion(child) for child in group.children]
        output = RequestOutput(group.request_id, group.prompt_token_ids, outputs, group.prompt)
        if output.finished:
            del self._groups[group_id]
        return output

    def _completion(self, request: Request) -> CompletionOutput:
        finished = request.finish_reason is not None
        text = ""
        if finished and request.sampling_params.detokenize and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        return CompletionOutput(
            index=request.sample_index,
            token_ids=list(request.output_token_ids),
            logprobs=list(request.output_logprobs),
            finish_reason=request.finish_reason,
            text=text,
            weight_version=self.weight_version,
        )

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; send token ids")
            token_ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            token_ids, text = list(prompt), None
        else:
            raise InvalidRequestError("a prompt must be a string or a list of token ids")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        vocab_size = self.limits.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
            )
        return text, token_ids


def _load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    if not any(
        os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return None
    return AutoTokenizer.from_pretrained(model_dir)


def _eos_token_ids(model_dir: str, hf_config, tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else the config, else the tokenizer."""
    from transformers import GenerationConfig

    candidates = None
    if os.path.exists(os.path.join(model_dir, "generation_config.json")):
        candidates = GenerationConfig.from_pretrained(model_dir).eos_token_id
    if candidates is None:
        candidates = getattr(hf_config, "eos_token_id", None)
    if candidates is None and tokenizer is not None:
        candidates = tokenizer.eos_token_id
    if candidates is None:
        return ()
    return tuple(candidates) if isinstance(candidates, (list, tuple)) else (int(candidates),)
