"""Wires processor, scheduler, drafter and worker; adds, aborts and steps requests."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from memory import MemoryEventLog
from rollout_engine.config import EngineConfig, RuntimeLimits
from rollout_engine.core.request import Request
from rollout_engine.core.scheduler import Scheduler
from rollout_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from rollout_engine.core.spec_decode import SpecDecoder
from rollout_engine.engine.input_processor import Processor
from rollout_engine.engine.kv_connector import EngineKVConnector
from rollout_engine.engine.output_processor import OutputProcessor, RequestGroup
from rollout_engine.engine.request_stats import RequestStats, RequestStatsSnapshot
from rollout_engine.engine.step_executor import FailedSteps, LandedStep, make_executor, run_here
from rollout_engine.engine.step_failures import dead_end_error, step_error
from rollout_engine.protocol import (
    KV_CACHE_TAG,
    EngineBusyError,
    EngineInfo,
    GrammarDeadEndError,
    InvalidRequestError,
    MemoryState,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    SleepLevel,
    SleepMode,
    StepFailedError,
    check_memory_tags,
    check_sleep_mode,
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

if TYPE_CHECKING:
    from rollout_engine.core.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)


class LLMEngine:
    """One model, one scheduler, one worker. `step()` advances every running request once."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = config.model_config.model
        self.hf_config = load_hf_config(model_dir, config.model_config.model_impl)
        max_model_len = _max_model_len(config, self.hf_config)
        self.processor = Processor(model_dir, self.hf_config, max_model_len)
        self.memory_events = MemoryEventLog(config.memory_config.timeline_max_events)
        """Sleep, wake and weight-update events of this engine, with their timing."""
        self.worker = _worker_class(config)(
            config, self.hf_config, max_model_len, self.memory_events, self._on_weight_update
        )
        self.worker.set_eos_token_ids(self.processor.eos_token_ids)
        self.limits = RuntimeLimits(
            num_blocks=self.worker.num_blocks,
            max_model_len=max_model_len,
            vocab_size=self.hf_config.vocab_size,
            eos_token_ids=self.processor.eos_token_ids,
        )
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, config.speculative_config, self.limits
        )
        self.scheduler.weight_version = self.weight_version
        spec_config = config.speculative_config
        self.async_scheduling = config.scheduler_config.async_scheduling
        self.drafter = None
        if spec_config.enabled and not self.async_scheduling:
            self.drafter = SpecDecoder(spec_config, max_model_len)
        self.output_processor = OutputProcessor(
            RequestStats(max_model_len, config.cache_config.enable_prefix_caching),
        )
        self._grammar_compiler: GrammarCompiler | None = None  # built at the first constraint
        self.cpu_threads: CpuThreadPolicy | None = None
        """On the CPU: the forward's OpenMP thread count (fixed, or the cores left free)."""
        if self.worker.device.type == "cpu":
            self.cpu_threads = CpuThreadPolicy(_cpu_threads(config))
        self.executor = make_executor(self.async_scheduling, self.worker.device, self._run_model)
        """Where the forward runs and what overlaps it (see step_executor.py)."""
        self._landed_outputs: list[RequestOutput] = []
        """Outputs of steps landed outside `step()` (before sleep...), returned by the next."""
        self.kv_connector = EngineKVConnector.build(
            config, self.hf_config, self.worker, self.scheduler
        )
        """Prefill–decode disaggregation (`kv_role`): saves and loads prompts' KV."""

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
    ) -> None:
        """Queue `sampling_params.n` completions of one prompt; bad input raises at once.
        `output_kind`: what the prompt's outputs from `step()` carry (see RequestOutputKind).
        `prompt_logprobs_from`: with `prompt_logprobs`, the first prompt position asked for
        (scoring asks for the completion's positions only: the prefix cache serves the rest)."""
        if request_id in self.output_processor:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not isinstance(sampling_params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams")
        if not self.scheduler.is_paused:  # paused: it queues for the resume, even mid-update
            self.worker.check_ready()
        text, token_ids = self.processor.encode(prompt, sampling_params.truncate_prompt_tokens)
        self.processor.check(sampling_params)
        kv_params = sampling_params.kv_transfer_params
        if kv_params is not None:
            if self.kv_connector is None:
                EngineKVConnector.refuse()
            if kv_params.do_remote_prefill and sampling_params.prompt_logprobs is not None:
                raise InvalidRequestError(
                    "prompt_logprobs with a KV transfer handle: the prompt's KV is loaded, not "
                    "computed here; ask the prefill engine for the prompt logprobs"
                )
            self.kv_connector.check_request(kv_params, token_ids)
        compiled = None
        if sampling_params.structured_outputs is not None:
            from rollout_engine.core.structured_output import RequestGrammar  # llguidance

            # A bad schema or regex is refused here, before any child is added.
            compiled = self._grammars().compile(sampling_params.structured_outputs)
        bad_words = self.processor.bad_words_token_ids(sampling_params)
        group = RequestGroup(request_id, text, token_ids, output_kind=output_kind)
        for j in range(sampling_params.n):
            child = Request(
                f"{request_id}/{j}", token_ids, sampling_params, group_id=request_id, sample_index=j
            )
            if compiled is not None:
                child.grammar = RequestGrammar(compiled)
            completion_text = self.processor.completion_text(sampling_params, token_ids)
            child.stop_checker = None if completion_text is None else completion_text.stop_checker
            child.bad_words_token_ids = bad_words
            if j == 0 and sampling_params.prompt_logprobs is not None:
                # One sample computes them for the prompt; its siblings reuse its KV.
                child.prompt_logprobs = [None] * len(token_ids)
                child.prompt_logprobs_start = max(1, min(prompt_logprobs_from, len(token_ids)))
            try:
                self.scheduler.add_request(child)
            except Exception:
                self.scheduler.finish_requests([c.request_id for c in group.children])
                raise
            group.children.append(child)
            group.texts.append(completion_text)
        self.output_processor.add(group)

    def _grammars(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            from rollout_engine.core.structured_output import GrammarCompiler  # llguidance

            if self.tokenizer is None:
                raise InvalidRequestError(
                    "structured outputs need the model's tokenizer, and this model has none"
                )
            self._grammar_compiler = GrammarCompiler(
                self.tokenizer, self.limits.vocab_size, self.limits.eos_token_ids
            )
        return self._grammar_compiler

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
            or bool(self._landed_outputs)
        )

    @property
    def is_frozen(self) -> bool:
        """Requests wait where they are: generation is paused, or the memory is asleep with
        requests kept across the sleep. `step()` schedules nothing then."""
        return self.scheduler.is_paused or not self.worker.is_ready

    def can_make_progress(self) -> bool:
        """Whether `step()` has work: steps in flight, outputs to hand out, or requests it may
        schedule (the engine loop waits for commands otherwise, instead of spinning)."""
        return (
            self.executor.num_in_flight > 0
            or bool(self._landed_outputs)
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

        schedule -> launch -> land -> update_from_output, with the executor deciding what
        overlaps what. Under async scheduling (DESIGN "The step loop") a step schedules and
        launches step N+1, then lands step N, so the host's scheduling and input preparation
        overlap the forward; the first call of a run only launches.

        A step whose forward or sampling raises ends the prompts it scheduled and raises; see
        `_fail_steps`. Requests it did not schedule go on at the next step.
        """
        self._before_schedule()
        launched = self.executor.overlap(self._schedule_and_launch)
        updated, landed = [], False
        if self.executor.num_in_flight and (
            not launched or self.executor.is_full or self.executor.oldest_is_done()
        ):
            updated, landed = self._land(), True
        outputs = self._landed_outputs + self.output_processor.outputs(updated, self.weight_version)
        self._landed_outputs = []
        if not (launched or landed or outputs) and self.has_unfinished_requests() and (
            not self.is_frozen
        ):
            self._wait_for_progress()
        return outputs

    def _before_schedule(self) -> None:
        """Hooks before scheduling: end requests whose constraint failed to compile, write the
        KV transfers that arrived (prefill-decode disaggregation)."""
        if self._grammar_compiler is not None:
            failed = self.scheduler.requests_with_failed_grammars()
            if failed:  # compiling their constraint failed: they end as "abort"
                logger.warning("ending %d requests whose constraint failed to compile", len(failed))
                self.abort_request(self.output_processor.group_ids_of(failed))
        if self.kv_connector is not None:
            self.kv_connector.land_loads()

    def _schedule_and_launch(self) -> bool:
        """Schedule a step if there is room in flight; launch it unless it is empty."""
        if self.executor.is_full or not self.scheduler.has_unfinished_requests():
            return False
        if not self.worker.is_ready and not self.scheduler.is_paused:
            return False  # asleep with requests kept: no step may run until the memory is back
        scheduler_output = self.scheduler.schedule()
        self.output_processor.stats.on_scheduled(scheduler_output.new_requests)
        if scheduler_output.kv_loads:
            self.kv_connector.start(scheduler_output.kv_loads)
        if scheduler_output.is_empty:
            self.scheduler.update_from_output(scheduler_output, ModelRunnerOutput({}))
            if scheduler_output.drops_requests:  # nothing to run, but the worker must know
                self.worker.drop_requests(scheduler_output)
            return False
        prepared = run_here(self.worker.prepare_model_input, scheduler_output)
        grammars = self.scheduler.grammars_of(scheduler_output)
        if grammars is not None and prepared.exception() is None:
            # Before the launch: a forward on another thread must find it and wait at sampling.
            prepared.result().token_bitmask = concurrent.futures.Future()
        self.executor.launch(
            scheduler_output, prepared, lambda step: self._compute_bitmask(step, grammars)
        )
        return True

    def _compute_bitmask(self, prepared: PreparedStep, grammars) -> None:
        """Structured outputs: the step's token bitmask, for its sampling to wait on."""
        if prepared.token_bitmask is None:
            return
        try:
            prepared.token_bitmask.set_result(self._grammar_compiler.bitmask(grammars))
        except BaseException as exc:  # noqa: BLE001 - the step fails with it
            prepared.token_bitmask.set_exception(exc)

    def _land(self) -> list[Request]:
        """Land the oldest step in flight and commit its tokens; the requests it updated.

        If it failed, the steps after it (which read its tokens) went with it, and every
        prompt they scheduled is ended: see `_fail_steps`. If a constraint of the step
        dead-ended, its prompt alone is ended: see `_end_dead_ended`.
        """
        landed = self.executor.land()
        if isinstance(landed, FailedSteps):
            error = self._fail_steps(landed.scheduler_outputs, landed.error)
            if error is landed.error:
                raise error
            raise error from landed.error
        updated = self.scheduler.update_from_output(landed.scheduler_output, landed.runner_output)
        self._after_update(landed)
        dead_ended = [r for r in updated if r.is_dead_ended]
        if dead_ended:
            raise self._end_dead_ended(dead_ended, updated)
        return updated

    def _after_update(self, landed: LandedStep) -> None:
        """Hooks after a step's tokens are committed: save the KV of finished prefills for a
        remote decode, and draft the next step's tokens (n-gram speculation)."""
        if self.kv_connector is not None:
            self.kv_connector.save_finished_prefills()
        if self.drafter is not None:
            self.drafter.record(landed.scheduler_output, landed.runner_output)
            drafts = self.drafter.propose(
                self.scheduler.requests_to_draft(), self.scheduler.num_running_requests
            )
            self.scheduler.update_draft_token_ids(drafts)

    def _wait_for_progress(self) -> None:
        """Nothing could be scheduled, launched or landed: wait (bounded) for a grammar to
        compile or a KV transfer to arrive; anything else is a stall, never a request that
        waits forever."""
        compiling = self.scheduler.compiling_grammars()
        if compiling:
            compiling[0].wait(timeout_s=0.05)
            return
        if self.kv_connector is not None and self.kv_connector.wait_for_loads(0.05):
            return
        self._fail_stalled()

    def _end_dead_ended(
        self, dead_ended: list[Request], updated: list[Request]
    ) -> GrammarDeadEndError:
        """Structured outputs: the prompts of requests whose constraint allowed no token of the
        vocabulary end (their other samples too), with an error naming only them; the step's
        outputs, theirs included, come from the next `step()`."""
        group_ids = self.output_processor.group_ids_of(r.request_id for r in dead_ended)
        self._landed_outputs += self.output_processor.outputs(updated, self.weight_version)
        self.abort_request(group_ids)
        logger.warning("ending %d prompts whose constraint dead-ended", len(group_ids))
        return dead_end_error(dead_ended[0], group_ids, self.limits.vocab_size)

    def _land_all(self) -> None:
        """Land every step in flight (before memory changes under them); their outputs, and
        the "abort" outputs of prompts a failed step ended, come from the next `step()`."""
        while self.executor.num_in_flight:
            try:
                updated = self._land()
            except Exception as exc:  # noqa: BLE001 - its prompts are ended; the call goes on
                logger.warning("a step in flight failed (%s: %s); its prompts were ended",
                               type(exc).__name__, exc)
                continue
            self._landed_outputs += self.output_processor.outputs(updated, self.weight_version)

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
        if self._grammar_compiler is not None:
            self._grammar_compiler.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.close()

    def _fail_steps(
        self, scheduler_outputs: list[SchedulerOutput], exc: BaseException
    ) -> BaseException:
        """Fault safety (DESIGN "The step loop"): the failed step's prompts are ended cleanly,
        with those of the steps launched after it (async scheduling).

        The steps leave no trace that could be read later: the ledger's positions for them
        are freed with the requests' blocks, and no block they wrote entered the prefix cache
        (blocks are cached only after the step writing them completes). The same happens
        offline and in the server; the error carries the ended prompts' ids
        (`request_ids`) so their callers get it. KeyboardInterrupt and other BaseExceptions
        are re-raised as they are, with `request_ids` set on them.
        """
        child_ids = [
            r.request_id for output in scheduler_outputs for r in output.scheduled_requests
        ]
        group_ids = self.output_processor.group_ids_of(child_ids)
        self.abort_request(group_ids)
        for scheduler_output in scheduler_outputs:
            self.scheduler.discard_step(scheduler_output)
        return step_error(exc, group_ids)

    def _fail_stalled(self) -> None:
        """No request can make progress: a bug, but never a request that waits forever."""
        stuck = self.output_processor.group_ids
        self.abort_request(stuck)
        raise StepFailedError(
            f"the scheduler made no progress on {len(stuck)} prompts; they were ended",
            request_ids=stuck,
        )

    # ------------------------------------------------------------------ sleep and wake
    def sleep(self, level: int = 1, mode: SleepMode = "abort") -> list[RequestOutput]:
        """Release memory. Level 1: weights to a host backup, KV discarded; level 2: both discarded.

        In-flight requests are first aborted ("abort") or run to completion ("wait"), and their
        final outputs returned; or kept ("keep"): frozen, their KV dropped with the pool, they
        go on (their KV recomputed from their tokens) once the engine is awake with valid
        weights again, whatever weights those are.
        """
        level, mode = SleepLevel.parse(level), check_sleep_mode(mode)
        with self.memory_events.span("engine_sleep", level=int(level), mode=mode):
            if mode == "keep":
                outputs = []
                self._land_all()
                self.scheduler.preempt_all_running()
            else:
                outputs = self._end_requests(mode)
                self._land_all()
            self.worker.sleep(level)
            self.reset_prefix_cache()
        return outputs

    # ------------------------------------------------------------------ pause
    def pause_generation(self, mode: SleepMode = "abort", clear_cache: bool = True
                         ) -> list[RequestOutput]:
        """Stop scheduling at a step boundary (vLLM's `pause_generation`): "abort" ends what
        is in flight, "wait" drains it first (their final outputs are returned), "keep"
        freezes it. Kept requests are, in ledger terms, preempted by recompute when
        `clear_cache` (their KV and the prefix cache dropped: recomputed on resume with the
        weights then loaded), or running requests that are not scheduled when not (their KV,
        from the weights of before, stays: an approximation). With "abort" and "wait",
        `clear_cache` resets the prefix cache (as vLLM's does). New requests queue until
        `resume_generation()`, also while the weights are asleep or half written (vLLM's
        pause blocks them the same way); `update_weights` is allowed while paused.
        """
        mode = check_sleep_mode(mode)
        outputs = [] if mode == "keep" else self._end_requests(mode)
        self._land_all()  # returns once no step runs; nothing is scheduled after this
        self.scheduler.is_paused = True
        if clear_cache:  # with "abort" and "wait" nothing is left in flight: the cache only
            if mode == "keep":
                self.scheduler.preempt_all_running()
            self.reset_prefix_cache()
        return outputs

    def resume_generation(self) -> None:
        """Schedule again: kept requests go on where they were."""
        self.scheduler.is_paused = False

    def is_paused(self) -> bool:
        return self.scheduler.is_paused

    def _check_not_paused_for(self, mode: SleepMode) -> None:
        if mode == "wait" and self.scheduler.is_paused:
            raise EngineBusyError(
                "generation is paused: its requests cannot drain; sleep with mode 'keep' or "
                "'abort', or resume_generation() first"
            )

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Map the named pools ("weights", "kv_cache"; all by default) again at the same addresses.

        Offloaded weights are restored. Weights discarded by sleep(level=2) stay invalid until
        a complete `update_weights`. Waking the KV cache resets the prefix cache. Requests kept
        across a level-2 sleep stay frozen until that update (not an error: the RL step pushes
        the weights next); a warning says so when everything is awake but the weights.
        """
        tags = check_memory_tags(tags)
        with self.memory_events.span("engine_wake_up", tags=tags):
            self._land_all()
            self.worker.wake_up(tags)
            if KV_CACHE_TAG in tags:
                self.reset_prefix_cache()
        memory = self.memory_state()
        if self.num_unfinished_requests and not memory.is_sleeping and not memory.weights_valid:
            logger.warning(
                "%d kept requests wait for a weight update: the weights (discarded by "
                "sleep(level=2)) are invalid until a complete update_weights(...)",
                self.num_unfinished_requests)

    def release_kv_cache_memory(self) -> list[RequestOutput]:
        """Abort in-flight requests and release the KV pool only; their outputs are returned."""
        with self.memory_events.span("engine_release_kv_cache_memory"):
            outputs = self._end_requests("abort")
            self._land_all()
            self.worker.release_kv_cache()
            self.reset_prefix_cache()
        return outputs

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; later requests recompute their prompts."""
        self.scheduler.reset_prefix_cache()

    def _on_weight_update(self) -> None:
        """A weight update completed: cached prefixes are stale, and the tokens the next steps
        commit are the new version's."""
        self.reset_prefix_cache()
        self.scheduler.weight_version = self.weight_version

    def memory_state(self) -> MemoryState:
        return self.worker.memory_state()

    def _end_requests(self, mode: SleepMode) -> list[RequestOutput]:
        """Abort or drain every unfinished prompt; their final outputs, in arrival order (a
        DELTA prompt's drain outputs all, its deltas before its final one: none is lost)."""
        group_ids = self.output_processor.group_ids
        self._check_not_paused_for(mode)
        if mode == "abort":
            self.abort_request(group_ids)
            return self.output_processor.final_outputs(group_ids, self.weight_version)
        keeps_all = {gid for gid in group_ids
                     if self.output_processor.output_kind(gid) is RequestOutputKind.DELTA}
        drained: dict[str, list[RequestOutput]] = {gid: [] for gid in group_ids}
        while self.has_unfinished_requests():
            for output in self.step():
                if output.request_id in drained and (
                    output.finished or output.request_id in keeps_all
                ):
                    drained[output.request_id].append(output)
        return [o for gid in group_ids for o in drained[gid]]

    # ------------------------------------------------------------------ weight updates
    def update_weights(self, named_tensors: NamedTensors) -> int:
        """Copy new values into the parameters, all checked first; the new weight version."""
        self._check_no_generation()
        return self.worker.weights.update(named_tensors)

    def begin_weight_update(self, manifest: Sequence[ManifestEntry]) -> WeightUpdateSession:
        """Validate every (name, shape, dtype) before a byte is written, then open a session.

        A refused manifest changes nothing. Once open, generation is refused until the
        session's `finish()`; an open earlier session is aborted (superseded).
        """
        self._check_no_generation()
        return self.worker.weights.begin(manifest)

    def _check_no_generation(self) -> None:
        self._land_all()  # a step in flight for a finished request still reads the weights
        if self.is_frozen:  # paused or asleep: kept requests go on with the new weights
            return
        num_generating = self.output_processor.num_generating()
        if num_generating:
            raise EngineBusyError(
                f"{num_generating} requests are still generating; let them finish or abort them "
                f"(e.g. sleep(mode='abort')) before updating weights, so that no completion "
                f"mixes two weight versions"
            )

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, float]:
        """Counters: KV blocks, requests running and waiting, preemptions, prefix-cache queries
        and hits, prompt and generated tokens, finished requests, speculative decoding."""
        stats: dict[str, float] = {
            "weight_version": self.weight_version,
            "num_unfinished_requests": self.num_unfinished_requests,
            "num_blocks": self.scheduler.num_blocks,
            "num_free_blocks": self.scheduler.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prefix_hit_tokens": self.scheduler.num_prefix_hit_tokens,
            "num_running_requests": self.scheduler.num_running_requests,
            "num_waiting_requests": len(self.scheduler.waiting),
            **self.output_processor.stats.counters(),
        }
        if self.drafter is not None:
            stats.update({f"spec_{k}": v for k, v in self.drafter.stats.as_dict().items()})
        if self.kv_connector is not None:
            stats.update(self.kv_connector.stats())
        return stats

    def request_stats(self) -> RequestStatsSnapshot:
        """Per-request timings and token counts since start (vLLM's request metrics)."""
        return self.output_processor.stats.snapshot()

    def info(self) -> EngineInfo:
        """What this engine is and how it is doing, as the server and clients see it."""
        memory = self.memory_state()
        return EngineInfo(
            model=self.config.model_config.model,
            architecture=(getattr(self.hf_config, "architectures", None) or [""])[0],
            vocab_size=self.limits.vocab_size,
            max_model_len=self.limits.max_model_len,
            dtype=str(self.worker.dtype).removeprefix("torch."),
            device=str(self.worker.device),
            weight_version=self.weight_version,
            config_json=json.dumps(dataclasses.asdict(self.config), default=str, sort_keys=True),
            num_blocks=self.scheduler.num_blocks,
            num_free_blocks=self.scheduler.num_free_blocks,
            block_size=self.config.cache_config.block_size,
            eos_token_ids=list(self.limits.eos_token_ids),
            is_sleeping=memory.is_sleeping,
            weights_valid=memory.weights_valid,
            engine_stats={k: float(v) for k, v in self.stats().items()},
            num_unfinished_requests=self.num_unfinished_requests,
        )

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
    max_position_embeddings = hf_config.max_position_embeddings
    max_model_len = config.scheduler_config.max_model_len or max_position_embeddings
    if max_model_len > max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{max_position_embeddings}"
        )
    return max_model_len
