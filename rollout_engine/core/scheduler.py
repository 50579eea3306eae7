"""The token ledger: decides, each step, how many positions each request computes. No torch.

See DESIGN.md "The token ledger". There is no prefill or decode phase: every request
asks for `num_tokens_with_spec - num_computed_tokens` positions and gets what the token
budget and the KV pool allow.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from rollout_engine.config import CacheConfig, RuntimeLimits, SchedulerConfig, SpeculativeConfig
from rollout_engine.core.kv_cache_manager import KVCacheManager, cdiv
from rollout_engine.core.kv_connector_scheduler import KVConnectorScheduler
from rollout_engine.core.request import Request, RequestStatus
from rollout_engine.core.scheduler_output import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from rollout_engine.core.step_budget import StepBudget, StepLimits
from rollout_engine.core.stop_conditions import append_sampled_tokens
from rollout_engine.protocol import FinishReason, InvalidRequestError, OutOfBlocksError

if TYPE_CHECKING:
    from rollout_engine.core.structured_output import RequestGrammar


class Scheduler:
    """Owns the waiting and running queues, the KV cache manager and preemption.

    Steps may be in flight while the next one is scheduled (async scheduling): each
    `schedule()` is answered by exactly one `update_from_output` (or `discard_step` if its
    compute failed), in order. A finished request's blocks are freed once no step in
    flight writes them.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        speculative_config: SpeculativeConfig | None = None,
        limits: RuntimeLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_loras: int = 0,
    ) -> None:
        num_blocks = limits.num_blocks if limits else cache_config.num_blocks
        max_model_len = limits.max_model_len if limits else scheduler_config.max_model_len
        if num_blocks is None or max_model_len is None:
            raise ValueError("pass RuntimeLimits, or set cache num_blocks and max_model_len")
        self.config = scheduler_config
        self.max_loras = max_loras
        """LoRA adapters the running requests may use at once (0: LoRA off)."""
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(limits.eos_token_ids if limits else ())
        self.async_scheduling = scheduler_config.async_scheduling
        # Drafts for step N+1 would need step N's tokens: no drafting under async scheduling.
        spec_enabled = (
            speculative_config is not None and speculative_config.enabled
            and not self.async_scheduling
        )
        self.num_draft_slots = speculative_config.num_speculative_tokens if spec_enabled else 0
        if scheduler_config.max_num_batched_tokens <= 2 * self.num_draft_slots:
            raise ValueError(
                f"max_num_batched_tokens ({scheduler_config.max_num_batched_tokens}) must exceed "
                f"2 * num_speculative_tokens ({self.num_draft_slots}); raise the token budget"
            )
        self.step_limits = StepLimits(
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            long_prefill_token_threshold=scheduler_config.long_prefill_token_threshold,
            num_draft_slots=self.num_draft_slots, max_model_len=max_model_len,
            async_scheduling=self.async_scheduling,
        )
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, cache_config.enable_prefix_caching
        )
        self.max_kv_keep_alive_s = (
            cache_config.max_kv_keep_alive_s if cache_config.enable_prefix_caching else 0.0
        )
        self._clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_request_ids: list[str] = []
        # Finished requests whose blocks a step in flight still writes (freed when it lands).
        self._finished_in_flight: dict[str, Request] = {}
        self.kv_connector = KVConnectorScheduler(self.kv_cache_manager)
        """Prefill–decode disaggregation: requests waiting for remote KV, and finished
        prefills holding their blocks until their KV is saved."""
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0
        self.is_paused = False
        """Paused (`pause_generation`): nothing is scheduled; requests wait where they are."""
        self.weight_version = 0
        """The weights the next step runs with: recorded on every token it commits."""
        self._preempted_between_steps: list[str] = []
        """Requests preempted outside `schedule()` (frozen by a pause or sleep), which the next
        step's output tells the worker to drop."""

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a request; refuses one that could never fit the model or the KV pool."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self._check_fits(request)
        if request.lora_id and not self.max_loras:
            raise InvalidRequestError("a LoRA request on a scheduler without LoRA (max_loras 0)")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def lora_ids_in_use(self) -> set[int]:
        """LoRA adapters that unfinished requests, or steps still in flight, run under."""
        requests = [*self.requests.values(), *self._finished_in_flight.values()]
        return {r.lora_id for r in requests if r.lora_id}

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason = "abort") -> None:
        """End requests from outside (abort); unknown or finished ids are ignored."""
        ids = {rid for rid in request_ids if rid in self.requests}
        if not ids:
            return
        self.running = [r for r in self.running if r.request_id not in ids]
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        for request_id in ids:
            self.kv_connector.cancel_load(request_id)
            self._finish(self.requests[request_id], reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_finished_in_flight(self) -> int:
        """Finished requests waiting for a step in flight to land before their blocks free."""
        return len(self._finished_in_flight)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running_requests(self) -> int:
        return len(self.running)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (weights changed, or the KV memory was released)."""
        self.kv_cache_manager.reset_prefix_cache()

    def preempt_all_running(self) -> int:
        """Freeze every running request by preemption by recompute (its KV freed, its tokens
        kept; newest first, so the queue keeps their order): what a pause or sleep in "keep"
        mode does to them when their KV must go. No step may be in flight. Returns how many."""
        assert not any(r.num_steps_in_flight for r in self.running), "land every step first"
        num_running = len(self.running)
        while self.running:
            victim = self.running.pop()
            self._preempt(victim)
            self._preempted_between_steps.append(victim.request_id)
        return num_running

    # ------------------------------------------------------------------ KV transfers
    def finish_kv_load(self, request_id: str, succeeded: bool) -> None:
        """A KV transfer ended (see `KVConnectorScheduler.finish_load`): its request goes
        back to the front of the queue, its prompt loaded or to be computed here."""
        request = self.kv_connector.finish_load(request_id, succeeded)
        if request is not None:
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    # ------------------------------------------------------------------ drafts
    def requests_to_draft(self) -> list[Request]:
        """Running requests that decode next step (one committed token without KV), in order.

        Read-only for the drafter: drafts come back through `update_draft_token_ids`.
        """
        return [
            r for r in self.running
            if r.num_tokens - r.num_computed_tokens == 1
            and not r.num_output_placeholders
        ]

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Take the drafter's proposals for the next step (the only writer of drafts)."""
        for request_id, drafts in draft_token_ids.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # ended since the drafter looked
            request.spec_token_ids = list(drafts)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Hand out this step's token budget: running requests first, then waiting ones."""
        self.kv_cache_manager.begin_step()
        if self.kv_cache_manager.holds:
            self.kv_cache_manager.holds.release_expired(self._clock())
        output = SchedulerOutput(finished_request_ids=self._finished_request_ids,
                                 preempted_request_ids=self._preempted_between_steps)
        self._finished_request_ids, self._preempted_between_steps = [], []
        if self.is_paused:
            return output  # nothing runs; the worker still hears of ended or frozen requests
        step = StepBudget(self.step_limits, output)
        # Groups whose shared prompt is written by a step still in flight (async scheduling).
        in_flight_groups = {r.group_id for r in self.running if self._prompt_in_flight(r)}
        num_frozen = len(output.preempted_request_ids)
        self._schedule_running(step)
        if len(output.preempted_request_ids) == num_frozen:  # none preempted for room now
            self._schedule_waiting(step, in_flight_groups)
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Commit sampled tokens, roll back rejected drafts, finish stopped requests.

        Returns the requests that received tokens or finished in this step.
        """
        updated: list[Request] = []
        for scheduled in scheduler_output.scheduled_requests:
            request = self._landed(scheduled)
            if request is None:
                continue  # ended, or preempted since it was scheduled: its output is stale
            prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
            if prompt_logprobs is not None:
                request.set_prompt_logprobs(*prompt_logprobs)
            sampled = runner_output.sampled_token_ids.get(request.request_id, [])
            logprobs = (runner_output.logprobs or {}).get(request.request_id)
            top_logprobs = runner_output.top_logprobs.get(request.request_id)
            num_drafts = scheduled.num_spec_tokens
            request.spec_token_ids = []
            assert len(sampled) <= num_drafts + 1, f"{len(sampled)} tokens for {num_drafts} drafts"
            assert sampled or num_drafts == 0, f"{request} had {num_drafts} drafts, sampled nothing"
            num_rejected = num_drafts - max(len(sampled) - 1, 0)
            request.num_draft_tokens += num_drafts
            request.num_accepted_draft_tokens += num_drafts - num_rejected
            # Rejected drafts' positions are recomputed next step (their KV is stale).
            request.num_computed_tokens -= num_rejected
            # The step completed: the KV it wrote, up to its last accepted position, is
            # committed (later positions may belong to steps still in flight).
            written = scheduler_output.num_scheduled_tokens[request.request_id] - num_rejected
            self.kv_cache_manager.cache_blocks(request, scheduled.start_position + written)
            if not sampled:
                continue  # a prefill chunk short of the prompt's end yields no token
            if scheduled.needs_sample and self.async_scheduling:
                request.num_output_placeholders -= 1
            reason = append_sampled_tokens(
                request, sampled, logprobs, top_logprobs, weight_version=self.weight_version,
                eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
            )
            if reason is not None:
                self._finish(request, reason)
            updated.append(request)
        if any(r.is_finished for r in updated):
            self.running = [r for r in self.running if not r.is_finished]
        return updated

    def requests_with_failed_grammars(self) -> list[str]:
        """Waiting requests whose constraint failed to compile (the engine ends them)."""
        return [
            r.request_id for r in self.waiting
            if r.grammar is not None and r.grammar.error is not None
        ]

    def compiling_grammars(self) -> list[RequestGrammar]:
        """Grammars that waiting requests wait for (structured outputs)."""
        return [
            r.grammar for r in self.waiting if r.grammar is not None and not r.grammar.is_ready
        ]

    def grammars_of(
        self, scheduler_output: SchedulerOutput
    ) -> list[tuple[RequestGrammar | None, list[int]]] | None:
        """For every request the step samples, in the sampler's order: its matcher (None if
        unconstrained) and its drafts. None when no scheduled request is constrained."""
        rows: list[tuple[RequestGrammar | None, list[int]]] = []
        for scheduled in scheduler_output.scheduled_requests:
            if scheduled.needs_sample:
                grammar = self.requests[scheduled.request_id].grammar
                drafts = scheduler_output.scheduled_spec_decode_tokens.get(
                    scheduled.request_id, []
                )
                rows.append((grammar, drafts))
        return rows if any(g is not None for g, _ in rows) else None

    def discard_step(self, scheduler_output: SchedulerOutput) -> None:
        """A scheduled step will never land (its compute failed). End its requests first
        (`finish_requests`): their blocks, held for this step, are freed here."""
        for scheduled in scheduler_output.scheduled_requests:
            request = self._landed(scheduled)
            assert request is None, f"{request} must be ended before its step is discarded"

    def _landed(self, scheduled: ScheduledRequest) -> Request | None:
        """Account for one request's step having landed; the request if its output counts."""
        request_id = scheduled.request_id
        request = self.requests.get(request_id) or self._finished_in_flight.get(request_id)
        if request is None:
            return None
        request.num_steps_in_flight -= 1
        if request.is_finished:
            if request.num_steps_in_flight == 0:
                del self._finished_in_flight[request_id]
                self._release_blocks(request)
            return None
        if request.status is not RequestStatus.RUNNING:
            return None
        if request.num_preemptions != scheduled.num_preemptions:
            return None
        return request

    # ------------------------------------------------------------------ internals
    def _schedule_running(self, step: StepBudget) -> None:
        index = 0
        while index < len(self.running) and step.num_tokens_left > 0:
            request = self.running[index]
            num_new = step.num_new_tokens(request)
            if num_new <= 0:
                index += 1
                continue
            while not self.kv_cache_manager.allocate_slots(request, num_new):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                step.output.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    return
            step.add(request, num_new, self.kv_cache_manager.get_block_ids(request.request_id))
            index += 1

    def _schedule_waiting(self, step: StepBudget, in_flight_groups: set[str]) -> None:
        held_back: list[Request] = []
        prefilling_groups = in_flight_groups | {
            r.group_id for r in self.running if self._is_prefilling_prompt(r)
        } | {r.group_id for r in self.kv_connector.loading_requests}
        running_loras = {r.lora_id for r in self.running if r.lora_id}
        while (self.waiting and step.num_tokens_left > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            grammar = request.grammar
            if grammar is not None and (not grammar.is_ready or grammar.error is not None):
                # Compiling (the others go on), or failed to: the engine ends it.
                held_back.append(self.waiting.popleft())
                continue
            if (request.lora_id and request.lora_id not in running_loras
                    and len(running_loras) >= self.max_loras):
                # Its adapter would be one more than the worker's slots: wait for one to free.
                held_back.append(self.waiting.popleft())
                continue
            if request.group_id in prefilling_groups and request.num_computed_tokens == 0:
                # A sibling is still writing this prompt's KV: wait and reuse its blocks.
                held_back.append(self.waiting.popleft())
                continue
            # A request whose KV a transfer loaded holds its blocks already.
            hit_blocks, num_hit_tokens = [], 0
            if request.num_computed_tokens == 0:
                hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            if request.wants_remote_kv:
                started = self._start_kv_load(step.output, request, hit_blocks, num_hit_tokens)
                if started is None:
                    break  # no room for its blocks
                if started:
                    prefilling_groups.add(request.group_id)
                    continue
            num_computed = request.num_computed_tokens + num_hit_tokens
            num_new = step.num_new_tokens(request, num_computed)
            if not self.kv_cache_manager.allocate_slots(request, num_new, hit_blocks):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_computed
            self.num_prefix_hit_tokens += num_hit_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.lora_id:
                running_loras.add(request.lora_id)
            step.add(request, num_new, self.kv_cache_manager.get_block_ids(request.request_id))
            if self._is_prefilling_prompt(request):
                prefilling_groups.add(request.group_id)
        self.waiting.extendleft(reversed(held_back))

    def _start_kv_load(
        self, output: SchedulerOutput, request: Request, hit_blocks, num_hit_tokens: int
    ) -> bool | None:
        """Hand the transfer of the request's remote KV to the worker (`SchedulerOutput.
        kv_loads`) and take it out of the queue until it lands. False if the local prefix
        cache covers as much; None if the pool has no room for the blocks."""
        # Its siblings will hit the cache once the load is done: only one of them loads.
        for sibling in self.waiting:
            if sibling is not request and sibling.group_id == request.group_id:
                sibling.kv_transfer_params = None
        num_external = self.kv_connector.num_external_tokens(request, num_hit_tokens)
        if num_external == 0:
            request.kv_transfer_params = None
            return False
        load = self.kv_connector.start_load(request, hit_blocks, num_hit_tokens, num_external)
        if load is None:
            return None
        self.waiting.popleft()
        self.num_prefix_hit_tokens += num_hit_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit_tokens
        output.kv_loads.append(load)
        return True

    def _is_prefilling_prompt(self, request: Request) -> bool:
        """True while the request's prompt is not all scheduled and has a full block to share:
        its siblings wait for it instead of computing the same prompt again. Blocks scheduled
        in this step are shared in this step (see KVCacheManager), cached ones after it."""
        if not self.kv_cache_manager.enable_prefix_caching:
            return False
        return (
            request.num_computed_tokens < request.num_prompt_tokens
            and request.num_prompt_tokens > self.block_size
        )

    def _prompt_in_flight(self, request: Request) -> bool:
        """Async scheduling: the request's last prompt chunk is in a step that has not landed,
        so its blocks are not cached yet; siblings wait one step to reuse them."""
        return (
            self.kv_cache_manager.enable_prefix_caching
            and request.num_prompt_tokens > self.block_size
            and request.num_output_tokens == 0
            and request.num_steps_in_flight > 0
        )

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the KV, keep the tokens, go to the queue's front."""
        # Its step in flight (if any) still writes the freed blocks, but any step that reuses
        # them runs after it: steps execute in the order they were scheduled.
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # in-flight outputs are stale: dropped on landing
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.num_tokens_on_worker = request.num_blocks_on_worker = 0  # the worker drops it
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.spec_token_ids = []
        if request.num_steps_in_flight:
            self._finished_in_flight[request.request_id] = request
        else:
            self._release_blocks(request)
        del self.requests[request.request_id]
        self._finished_request_ids.append(request.request_id)

    def _release_blocks(self, request: Request) -> None:
        """A finished request no step in flight writes: free its blocks, unless it is a
        prefill whose KV a decode engine waits for (freed once saved). A request that asked
        for it (`SamplingParams.kv_keep_alive_s`) and was not aborted keeps its cached blocks
        warm for the conversation's next turn (see KVHolds)."""
        if self.kv_connector.hold_for_save(request):
            return
        keep_s = min(request.sampling_params.kv_keep_alive_s, self.max_kv_keep_alive_s)
        if keep_s > 0 and request.finish_reason != "abort":
            self.kv_cache_manager.free(request, hold_until_s=self._clock() + keep_s)
        else:
            self.kv_cache_manager.free(request)

    def _check_fits(self, request: Request) -> None:
        if request.num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {request.num_prompt_tokens} tokens but max_model_len is "
                f"{self.max_model_len}; shorten the prompt (room for at least one new token)"
            )
        # KV is never needed for the last token, nor past the model length.
        max_len = min(
            request.num_prompt_tokens + request.sampling_params.max_tokens, self.max_model_len
        )
        num_positions = min(max_len - 1 + self.num_draft_slots, self.max_model_len)
        num_blocks_needed = cdiv(num_positions, self.block_size)
        if num_blocks_needed > self.kv_cache_manager.num_blocks:
            raise OutOfBlocksError(
                f"a request of up to {max_len} tokens needs {num_blocks_needed} KV blocks but the "
                f"pool has {self.kv_cache_manager.num_blocks}; enlarge the KV cache or lower "
                f"max_tokens"
            )
