"""One step's token budget as it is handed out: how many positions a request may take, and the
share it is given (its ledger advanced, its delta written for the worker). No torch.

See DESIGN.md "The token ledger": a request is given
`n = min(num_tokens_with_spec - num_computed_tokens, token_budget,
max_num_batched_tokens - draft_slots, model-length cap)` positions, and
`num_computed_tokens += n` at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_engine.core.request import Request
from rollout_engine.core.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class StepLimits:
    """What bounds a request's share of any step; fixed for the scheduler's life."""

    max_num_batched_tokens: int
    """The token budget of a step."""
    long_prefill_token_threshold: int
    """A prompt chunk's cap (0: none)."""
    num_draft_slots: int
    """Drafts a decoding request may verify per step (0: no drafting)."""
    max_model_len: int
    async_scheduling: bool
    """Steps are scheduled before the one in flight lands (outputs held as placeholders)."""


class StepBudget:
    """One step being scheduled: its `SchedulerOutput`, and what is left of its token budget."""

    def __init__(self, limits: StepLimits, output: SchedulerOutput) -> None:
        self.limits = limits
        self.output = output
        self.num_tokens_left = limits.max_num_batched_tokens

    def num_new_tokens(self, request: Request, num_computed: int | None = None) -> int:
        """Positions the request may compute in this step, from `num_computed` (its ledger's
        by default; more for a waiting request with prefix-cache hits)."""
        limits = self.limits
        computed = request.num_computed_tokens if num_computed is None else num_computed
        if request.num_output_placeholders and not self._can_schedule_ahead(request):
            return 0
        num_new = request.num_tokens_with_spec + request.num_output_placeholders - computed
        if limits.long_prefill_token_threshold > 0:
            num_new = min(num_new, limits.long_prefill_token_threshold)
        return min(
            num_new,
            self.num_tokens_left,
            # Keep one long prompt from eating the room that drafting needs.
            limits.max_num_batched_tokens - limits.num_draft_slots,
            limits.max_model_len - computed,
        )

    def add(self, request: Request, num_new: int, block_ids: list[int]) -> None:
        """Give the request `num_new` positions, KV slots already allocated (`block_ids` is its
        block table): write its share of the step (the worker's delta) and advance its ledger."""
        start = request.num_computed_tokens
        from_previous_step = start >= request.num_tokens
        if from_previous_step:  # async: the input is the token the step in flight samples
            assert num_new == 1 and start == request.num_tokens, request
            num_spec = 0
        else:
            num_spec = max(0, start + num_new - request.num_tokens)
            del request.spec_token_ids[num_spec:]  # drafts that did not fit are dropped
        output = self.output
        new_token_ids = self._tokens_to_send(request)
        new_block_ids = block_ids[request.num_blocks_on_worker :]
        request.num_blocks_on_worker = len(block_ids)
        needs_sample = start + num_new >= request.num_tokens
        output.scheduled_requests.append(
            ScheduledRequest(
                request_id=request.request_id,
                start_position=start,
                num_tokens=num_new,
                new_token_ids=new_token_ids,
                new_block_ids=new_block_ids,
                spec_token_ids=list(request.spec_token_ids),
                needs_sample=needs_sample,
                num_output_tokens=request.num_output_tokens + request.num_output_placeholders,
                input_from_previous_step=from_previous_step,
                num_preemptions=request.num_preemptions,
            )
        )
        request.num_steps_in_flight += 1
        if needs_sample and self.limits.async_scheduling:
            request.num_output_placeholders += 1
        output.num_scheduled_tokens[request.request_id] = num_new
        if num_spec:
            output.scheduled_spec_decode_tokens[request.request_id] = list(request.spec_token_ids)
        output.total_num_scheduled_tokens += num_new
        request.num_computed_tokens = start + num_new
        self.num_tokens_left -= num_new

    def _tokens_to_send(self, request: Request) -> list[int]:
        """The committed tokens the worker has not been sent. A request it does not hold (new,
        or resumed after a preemption) is sent whole, once, as `NewRequestData`."""
        if request.num_tokens_on_worker == 0:
            self.output.new_requests.append(NewRequestData(
                request_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                sample_index=request.sample_index,
                bad_words_token_ids=request.bad_words_token_ids,
                prompt_logprobs_start=request.prompt_logprobs_start,
                lora_id=request.lora_id,
            ))
            new_token_ids = []
        else:
            new_token_ids = request.all_token_ids[request.num_tokens_on_worker :]
        request.num_tokens_on_worker = request.num_tokens
        return new_token_ids

    def _can_schedule_ahead(self, request: Request) -> bool:
        """Whether a request with an output in flight gets more work before it lands: not if
        that output may be its last, nor if sampling needs its tokens on the host."""
        params = request.sampling_params
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        return (
            request.num_output_placeholders == 1  # one step ahead: its input is that output
            and num_outputs < params.max_tokens
            and request.num_tokens + request.num_output_placeholders < self.limits.max_model_len
            and params.repetition_penalty == 1.0  # penalties and bad words read the output
            and not params.any_output_penalty
            and all(len(word) == 1 for word in request.bad_words_token_ids)
            and request.grammar is None  # its mask needs the token in flight
        )
