"""Wires tokenizer, scheduler and model runner; adds, aborts and steps requests."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from memory import MemoryTimeline
from rollout_engine.config import EngineConfig, RuntimeLimits
from rollout_engine.engine_memory import KV_CACHE_TAG, EngineMemory, MemoryState, check_tags
from rollout_engine.errors import InvalidRequestError, WeightUpdateError
from rollout_engine.model_runner import KVCacheSpec, ModelRunner
from rollout_engine.models.loader import (
    build_model, iterate_checkpoint, load_hf_config, load_weights, parameter_nbytes, resolve_dtype,
)
from rollout_engine.outputs import CompletionOutput, RequestOutput
from rollout_engine.request import Request
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler import Scheduler
from rollout_engine.spec_decode import SpecDecoder
from rollout_engine.weight_update import (
    ManifestEntry, NamedTensors, WeightUpdateSession, materialize, plan_update, weight_targets,
)

SleepMode = Literal["abort", "wait"]


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
        self.memory_timeline = MemoryTimeline(config.memory_config.timeline_max_events)
        self.memory = EngineMemory(self.device, self.memory_timeline)
        weights_pool = self.memory.create_weights_pool(parameter_nbytes(self.hf_config, self.dtype))
        model = build_model(
            self.hf_config, self.dtype, self.device, max_model_len, allocate=weights_pool.allocate
        )
        load_weights(model, iterate_checkpoint(model_config.model))
        self._weight_params, self._weight_aliases = weight_targets(model)
        self._update_session: WeightUpdateSession | None = None
        self.kv_spec = KVCacheSpec.from_model(
            self.hf_config, config.cache_config.block_size, self.dtype
        )
        num_blocks = self.kv_spec.num_blocks_for(config.cache_config)
        heads_major = self.device.type == "cpu"
        kv_storage = self.memory.allocate_kv_cache(
            self.kv_spec.storage_shape(num_blocks, heads_major), self.dtype
        )
        kv_caches = self.kv_spec.logical_view(kv_storage, heads_major)
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
        spec_config = config.speculative_config
        self.spec_decoder = SpecDecoder(spec_config, max_model_len) if spec_config.enabled else None
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
        self.memory.check_ready()
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

    def stats(self) -> dict[str, float]:
        """Counters: KV blocks, preemptions, prefix-cache hits, speculative decoding."""
        manager = self.scheduler.kv_cache_manager
        stats: dict[str, float] = {
            "weight_version": self.weight_version,
            "num_unfinished_requests": self.num_unfinished_requests,
            "num_blocks": manager.num_blocks,
            "num_free_blocks": manager.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prefix_hit_tokens": self.scheduler.num_prefix_hit_tokens,
        }
        if self.spec_decoder is not None:
            stats.update({f"spec_{k}": v for k, v in self.spec_decoder.stats.as_dict().items()})
        return stats

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, commit tokens; outputs of prompts that progressed."""
        if self.scheduler.has_unfinished_requests():
            self.memory.check_ready()  # never run the model on released or half-written memory
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute(scheduler_output)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.spec_decoder is not None:
            self.spec_decoder.record(scheduler_output, runner_output)
            self.spec_decoder.propose(self.scheduler.running, len(self.scheduler.running))
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

    # ------------------------------------------------------------------ sleep and wake
    def sleep(self, level: int = 1, mode: SleepMode = "abort") -> list[RequestOutput]:
        """Release memory. Level 1: weights to a host backup, KV discarded; level 2: both discarded.

        In-flight requests are first aborted ("abort") or run to completion ("wait"); their
        final outputs are returned.
        """
        if isinstance(level, bool) or level not in (1, 2):
            raise InvalidRequestError(
                f"sleep level must be 1 (offload weights to host memory, discard the KV cache) "
                f"or 2 (discard both), got {level!r}"
            )
        if mode not in ("abort", "wait"):
            raise InvalidRequestError(f"sleep mode must be 'abort' or 'wait', got {mode!r}")
        with self.memory_timeline.span("engine_sleep", level=level, mode=mode):
            outputs = self._end_requests(mode)
            self._close_update_session("sleep() released the weights")
            self.memory.sleep(level)
            self.reset_prefix_cache()
        return outputs

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Map the named pools ("weights", "kv_cache"; all by default) again at the same addresses.

        Offloaded weights are restored. Weights discarded by sleep(level=2) stay invalid until
        a complete `update_weights`. Waking the KV cache resets the prefix cache.
        """
        tags = check_tags(tags)
        with self.memory_timeline.span("engine_wake_up", tags=tags):
            self.memory.wake_up(tags)
            if KV_CACHE_TAG in tags:
                self.reset_prefix_cache()

    def release_kv_cache_memory(self) -> list[RequestOutput]:
        """Abort in-flight requests and release the KV pool only; their outputs are returned."""
        with self.memory_timeline.span("engine_release_kv_cache_memory"):
            outputs = self._end_requests("abort")
            self.memory.release_kv_cache()
            self.reset_prefix_cache()
        return outputs

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; later requests recompute their prompts."""
        self.scheduler.kv_cache_manager.reset_prefix_cache()

    def memory_state(self) -> MemoryState:
        return self.memory.state()

    def kv_cache_ptr(self) -> int:
        """Address of the KV cache tensor the runner uses; stable across sleep and wake."""
        return self.model_runner.kv_caches.data_ptr()

    def weight_ptrs(self) -> dict[str, int]:
        """Address of every parameter the model uses; stable across sleep, wake and updates."""
        return {name: p.data_ptr() for name, p in self.model_runner.model.named_parameters()}

    def _end_requests(self, mode: SleepMode) -> list[RequestOutput]:
        """Abort or drain every unfinished request; their final outputs, in arrival order."""
        group_ids = list(self._groups)
        if mode == "abort":
            self.abort_request(group_ids)
            self._aborted_group_ids.difference_update(group_ids)
            return [self._make_output(gid) for gid in group_ids]
        assert mode == "wait", mode
        finished: dict[str, RequestOutput] = {}
        while self._groups:
            finished.update((o.request_id, o) for o in self.step() if o.finished)
        return [finished[gid] for gid in group_ids if gid in finished]

    # ------------------------------------------------------------------ weight updates
    def update_weights(self, named_tensors: NamedTensors) -> int:
        """Copy new values into the parameters, all checked first; the new weight version."""
        items = materialize(named_tensors)
        session = self.begin_weight_update([(n, tuple(t.shape), t.dtype) for n, t in items])
        try:
            for name, tensor in items:
                session.write(name, tensor)
        except BaseException:
            session.abort("a write failed")
            raise
        return session.finish()

    def begin_weight_update(self, manifest: Sequence[ManifestEntry]) -> WeightUpdateSession:
        """Validate every (name, shape, dtype) before a byte is written, then open a session.

        A refused manifest changes nothing. Once open, generation is refused until the
        session's `finish()`; an open earlier session is aborted (superseded).
        """
        self.memory.check_weights_mapped()
        num_running = sum(any(not c.is_finished for c in g.children) for g in self._groups.values())
        if num_running:
            raise WeightUpdateError(
                f"{num_running} requests are still generating; let them finish or abort them "
                f"(e.g. sleep(mode='abort')) before updating weights, so that no completion "
                f"mixes two weight versions"
            )
        require_all = None
        if not self.memory.weights_valid:
            require_all = (
                "the current weights are not valid (discarded by sleep(level=2), or an earlier "
                "update was cut off)"
            )
        plan = plan_update(manifest, self._weight_params, self._weight_aliases, require_all)
        self._close_update_session("a newer begin_weight_update superseded it")
        self.memory.begin_weight_update()
        session = WeightUpdateSession(plan, self._finish_update, self._on_update_closed)
        self._update_session = session
        self.memory_timeline.record(
            "weight_update", phase="begin", tag="weights", num_bytes=session.num_bytes
        )
        return session

    def _finish_update(self, session: WeightUpdateSession) -> int:
        assert session is self._update_session, "a closed session finished"
        self._update_session = None
        self.memory.finish_weight_update()
        self.reset_prefix_cache()
        self.weight_version += 1
        self.memory_timeline.record(
            "weight_update", phase="end", tag="weights", num_bytes=session.num_bytes,
            weight_version=self.weight_version,
        )
        return self.weight_version

    def _on_update_closed(self, session: WeightUpdateSession, reason: str) -> None:
        if session is self._update_session:
            self._update_session = None
        self.memory_timeline.record("weight_update", phase="abort", tag="weights", reason=reason)

    def _close_update_session(self, reason: str) -> None:
        if self._update_session is not None:
            self._update_session.abort(reason)


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
