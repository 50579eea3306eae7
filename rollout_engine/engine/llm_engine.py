"""LLMEngine: wires the input processor, scheduler, step executor, worker and output processor."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from memory import MemoryEventLog
from rollout_engine.config import EngineConfig, RuntimeLimits
from rollout_engine.core.request import Request
from rollout_engine.core.scheduler import Scheduler
from rollout_engine.core.scheduler_output import ModelRunnerOutput
from rollout_engine.core.spec_decode import SpecDecoder
from rollout_engine.engine.engine_control import EngineControl, EngineMode
from rollout_engine.engine.engine_info import engine_info, engine_stats
from rollout_engine.engine.input_processor import InputProcessor
from rollout_engine.engine.kv_connector import EngineKVConnector
from rollout_engine.engine.lora_registry import LoRARegistry
from rollout_engine.engine.output_processor import OutputProcessor
from rollout_engine.engine.request_stats import RequestStats, RequestStatsSnapshot
from rollout_engine.engine.step_executor import make_executor, run_here
from rollout_engine.engine.step_hooks import StepHooks
from rollout_engine.engine.step_landing import StepLander
from rollout_engine.protocol import (
    EngineInfo,
    InvalidRequestError,
    LoRARequest,
    MemoryState,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from rollout_engine.worker.cpu_threads import CpuThreadPolicy
from rollout_engine.worker.model_runner import PreparedStep
from rollout_engine.worker.weights.loader import load_hf_config
from rollout_engine.worker.weights.weight_update import (
    ManifestEntry,
    NamedTensors,
    WeightUpdateSession,
)
from rollout_engine.worker.worker import Worker


class LLMEngine:
    """One model, one scheduler, one worker. `step()` advances every running request once."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = config.model_config.model
        self.hf_config = load_hf_config(model_dir, config.model_config.model_impl)
        max_model_len = _max_model_len(config, self.hf_config)
        self.processor = InputProcessor(model_dir, self.hf_config, max_model_len)
        """Prompts in: each checked and assembled into a RequestSpec."""
        self.memory_events = MemoryEventLog(config.memory_config.timeline_max_events)
        """Sleep, wake and weight-update events of this engine, with their timing."""
        self._init_worker(max_model_len)
        self._init_scheduler(max_model_len)
        self._init_step_loop(max_model_len)

    def _init_worker(self, max_model_len: int) -> None:
        self.worker = _worker_class(self.config)(
            self.config, self.hf_config, max_model_len, self.memory_events, self._on_weight_update
        )
        self.worker.set_eos_token_ids(self.processor.eos_token_ids)
        self.limits = RuntimeLimits(
            num_blocks=self.worker.num_blocks,
            max_model_len=max_model_len,
            vocab_size=self.hf_config.vocab_size,
            eos_token_ids=self.processor.eos_token_ids,
        )

    def _init_scheduler(self, max_model_len: int) -> None:
        config = self.config
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, config.speculative_config, self.limits,
            max_loras=config.lora_config.max_loras if config.lora_config.enable_lora else 0,
        )
        self.loras = LoRARegistry(config.lora_config, self.worker, self._lora_ids_in_use)
        """LoRA adapters by name and id (`enable_lora`)."""
        self.scheduler.weight_version = self.weight_version
        self.async_scheduling = config.scheduler_config.async_scheduling
        self.drafter: SpecDecoder | None = None
        if config.speculative_config.enabled and not self.async_scheduling:
            self.drafter = SpecDecoder(config.speculative_config, max_model_len)
        self.kv_connector = EngineKVConnector.build(config, self.hf_config, self.worker,
                                                    self.scheduler)
        """Prefill–decode disaggregation (`kv_role`): saves and loads prompts' KV."""

    def _init_step_loop(self, max_model_len: int) -> None:
        stats = RequestStats(max_model_len, self.config.cache_config.enable_prefix_caching)
        self.output_processor = OutputProcessor(stats)
        self.cpu_threads: CpuThreadPolicy | None = None
        """On the CPU: the forward's OpenMP thread count (fixed, or the cores left free)."""
        if self.worker.device.type == "cpu":
            self.cpu_threads = CpuThreadPolicy(_cpu_threads(self.config))
        self.executor = make_executor(self.async_scheduling, self.worker.device, self._run_model)
        """Where the forward runs and what overlaps it (see step_executor.py)."""
        self.hooks = StepHooks(self.scheduler, self.processor, self.output_processor,
                               self.kv_connector, self.drafter, self.abort_request)
        """The host work around each step (structured outputs, KV transfers, drafting)."""
        self.lander = StepLander(
            self.executor, self.scheduler, self.output_processor, self.abort_request,
            self.hooks.after_update, lambda: self.weight_version, self.limits.vocab_size,
            routed_experts=self.worker.routed_experts,
        )
        self.control = EngineControl(
            self.scheduler, self.worker, self.lander, self.output_processor, self.memory_events,
            self.abort_request,
        )
        """Pause, sleep, wake, KV release and weight updates, between steps."""

    @property
    def kv_transfer(self):
        """The worker's KV transfer (its store, fetch settings); None without a kv_role."""
        return None if self.kv_connector is None else self.kv_connector.transfer

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def weight_version(self) -> int:
        return self.worker.weights.weight_version

    @property
    def device(self):
        """The torch device the model runs on."""
        return self.worker.device

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        prompt_logprobs_from: int = 1,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue `sampling_params.n` completions of one prompt; bad input raises at once and
        queues none. `output_kind`: what the prompt's outputs from `step()` carry (see
        RequestOutputKind); `prompt_logprobs_from`: see `InputProcessor.process`;
        `lora_request`: the LoRA adapter they run under (loaded first if it is not)."""
        if request_id in self.output_processor:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not self.scheduler.is_paused:  # paused: it queues for the resume, even mid-update
            self.worker.check_ready()
        if (self.config.model_config.return_sampling_mask
                and isinstance(sampling_params, SamplingParams)
                and not sampling_params.return_sampling_mask):
            sampling_params = dataclasses.replace(sampling_params, return_sampling_mask=True)
        spec = self.processor.process(request_id, prompt, sampling_params, output_kind,
                                      prompt_logprobs_from, self.kv_connector)
        if lora_request is not None:
            spec = dataclasses.replace(spec, lora_id=self.loras.resolve(lora_request))
        group = spec.new_group()
        self._queue(group.children)
        self.output_processor.add(group)

    def _queue(self, requests: list[Request]) -> None:
        """Hand a prompt's requests to the scheduler: all, or none if one is refused."""
        for i, request in enumerate(requests):
            try:
                self.scheduler.add_request(request)
            except Exception:
                self.scheduler.finish_requests([r.request_id for r in requests[:i]])
                raise

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter from its path (vLLM's `add_lora`); False if it is loaded."""
        return self.loras.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; False if none has this id."""
        return self.loras.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """The `lora_int_id`s of the loaded adapters (vLLM's `list_loras`)."""
        return {request.lora_int_id for request in self.loras.list()}

    def _lora_ids_in_use(self) -> set[int]:
        """Adapters of unfinished requests, and of finished ones a step in flight still runs."""
        return self.scheduler.lora_ids_in_use()

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """End prompts now; their outputs come back from the next `step()` as "abort"."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(self.output_processor.children_of(ids), "abort")
        self.output_processor.mark_aborted(ids)

    def has_unfinished_requests(self) -> bool:
        """Prompts not finished yet, steps whose outputs have not landed, or outputs not
        returned yet: keep stepping."""
        return (
            len(self.output_processor) > 0
            or self.executor.num_in_flight > 0
            or bool(self.lander.pending_outputs)
        )

    @property
    def is_frozen(self) -> bool:
        """Paused, or asleep with requests kept: `step()` schedules nothing then."""
        return self.control.is_frozen

    def can_make_progress(self) -> bool:
        """Whether `step()` has work: steps in flight, outputs to hand out, or requests it may
        schedule (the engine loop waits for commands otherwise, instead of spinning)."""
        return (
            self.executor.num_in_flight > 0
            or bool(self.lander.pending_outputs)
            or self.output_processor.owes_outputs
            or (len(self.output_processor) > 0 and not self.is_frozen)
        )

    @property
    def num_steps_in_flight(self) -> int:
        """Steps launched whose outputs have not landed (at most 2, under async scheduling)."""
        return self.executor.num_in_flight

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor)

    @property
    def unfinished_request_ids(self) -> list[str]:
        return self.output_processor.group_ids

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, commit tokens; outputs of the prompts that progressed.

        schedule -> launch -> land -> update_from_output, the executor deciding what overlaps
        what: under async scheduling a step launches step N+1, then lands step N (the first call
        of a run only launches). A step whose forward or sampling raises ends the prompts it
        scheduled and raises (see `StepLander`); the others go on at the next step.
        """
        self.hooks.before_schedule()
        launched = self.executor.overlap(self._schedule_and_launch)
        updated, landed = [], False
        if self.executor.num_in_flight and (
            not launched or self.executor.is_full or self.executor.oldest_is_done()
        ):
            updated, landed = self.lander.land(), True
        outputs = self.output_processor.outputs(updated, self.weight_version)
        outputs = self.lander.take_pending_outputs() + outputs
        if not (launched or landed or outputs) and self.has_unfinished_requests() and (
            not self.is_frozen
        ):
            self.hooks.wait_for_progress()
        return outputs

    def _schedule_and_launch(self) -> bool:
        """Schedule a step if there is room in flight; launch it unless it is empty."""
        if self.executor.is_full or not self.scheduler.has_unfinished_requests():
            return False
        if not self.worker.is_ready and not self.scheduler.is_paused:
            return False  # asleep with requests kept: no step may run until the memory is back
        scheduler_output = self.scheduler.schedule()
        self.hooks.after_schedule(scheduler_output)
        if scheduler_output.is_empty:
            self.scheduler.update_from_output(scheduler_output, ModelRunnerOutput({}))
            if scheduler_output.drops_requests:  # nothing to run, but the worker must know
                self.worker.drop_requests(scheduler_output)
            return False
        prepared = run_here(self.worker.prepare_model_input, scheduler_output)
        host_work = self.hooks.beside_forward(scheduler_output, prepared)
        self.executor.launch(scheduler_output, prepared, host_work)
        return True

    def _run_model(self, prepared: PreparedStep) -> ModelRunnerOutput:
        """The device half of a step; on the CPU with the thread count the CPU policy gives."""
        if self.cpu_threads is None:
            return self.worker.run_model(prepared)
        return self.cpu_threads.run(self.worker.run_model, prepared)

    def shutdown(self) -> None:
        """Stop the engine's threads (forward or host, grammar compiling) and the processes of
        the other tensor-parallel ranks; steps in flight are waited for."""
        self.executor.shutdown()
        self.worker.shutdown()
        self.processor.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.close()

    # ------------------------------------------------------------------ between steps
    def sleep(self, level: int = 1, mode: EngineMode = "abort") -> list[RequestOutput]:
        """Release memory, the requests in flight ended or kept (`EngineControl.sleep`); to
        drain them first, step until none is left (`LLM.sleep(mode="wait")` does)."""
        return self.control.sleep(level, mode)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Map the named pools again, at the same addresses (`EngineControl.wake_up`)."""
        self.control.wake_up(tags)

    def release_kv_cache_memory(self) -> list[RequestOutput]:
        """Abort in-flight requests and release the KV pool only; their outputs are returned."""
        return self.control.release_kv_cache()

    def pause_generation(self, mode: EngineMode = "abort", clear_cache: bool = True
                         ) -> list[RequestOutput]:
        """Stop scheduling at a step boundary, the requests in flight ended or kept
        (`EngineControl.pause`); `LLM.pause_generation("wait")` drains them first."""
        return self.control.pause(mode, clear_cache)

    def resume_generation(self) -> None:
        """Schedule again: kept requests go on where they were."""
        self.control.resume()

    def is_paused(self) -> bool:
        return self.scheduler.is_paused

    def update_weights(self, named_tensors: NamedTensors) -> int:
        """Copy new values into the parameters, all checked first; the new weight version."""
        return self.control.update_weights(named_tensors)

    def begin_weight_update(self, manifest: Sequence[ManifestEntry]) -> WeightUpdateSession:
        """Validate the whole manifest, then open an update session (see `EngineControl`)."""
        return self.control.begin_weight_update(manifest)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; later requests recompute their prompts."""
        self.scheduler.reset_prefix_cache()

    def reset_draft_history(self) -> None:
        """Forget the earlier completions suffix drafting drafts from (their tokens stay valid
        across weight updates: this is for a new dataset, not for a new policy)."""
        if self.drafter is not None:
            self.drafter.reset_history()

    def memory_state(self) -> MemoryState:
        return self.worker.memory_state()

    def _on_weight_update(self) -> None:
        """A weight update completed: cached prefixes are stale, and the tokens the next steps
        commit are the new version's."""
        self.reset_prefix_cache()
        self.scheduler.weight_version = self.weight_version

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, float]:
        """Counters (see `engine_info.engine_stats`)."""
        return engine_stats(self)

    def request_stats(self) -> RequestStatsSnapshot:
        """Per-request timings and token counts since start (vLLM's request metrics)."""
        return self.output_processor.stats.snapshot()

    def info(self) -> EngineInfo:
        """What this engine is and how it is doing, as the server and clients see it."""
        return engine_info(self)

    def kv_cache_ptr(self) -> int:
        """Address of the KV cache tensor the runner uses; stable across sleep and wake."""
        return self.worker.kv_cache_ptr()

    def weight_ptrs(self) -> dict[str, int]:
        """Address of every parameter the model uses; stable across sleep, wake and updates."""
        return self.worker.weight_ptrs()


def _worker_class(config: EngineConfig) -> type[Worker]:
    """The plain Worker, or under tensor parallelism rank 0's, which starts the others."""
    if config.parallel_config.tensor_parallel_size == 1:
        return Worker
    from rollout_engine.worker.tp.tp_driver import DriverWorker

    return DriverWorker


def _cpu_threads(config: EngineConfig) -> int | None:
    """The forward's fixed CPU thread count, if any: under tensor parallelism each rank gets
    its share of the cores."""
    if config.parallel_config.tensor_parallel_size == 1:
        return config.model_config.cpu_threads
    from rollout_engine.worker.tp.tp_driver import cpu_threads_per_rank

    return cpu_threads_per_rank(config)


def _max_model_len(config: EngineConfig, hf_config) -> int:
    max_model_len = config.scheduler_config.max_model_len or hf_config.max_position_embeddings
    if max_model_len > hf_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{hf_config.max_position_embeddings}"
        )
    return max_model_len
