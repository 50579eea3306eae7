"""One completion being generated: its tokens and its place in the token ledger."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rollout_engine.protocol import (
    FinishReason,
    KVTransferParams,
    SamplingParams,
    TopLogprobs,
    WeightVersionSpan,
)

if TYPE_CHECKING:
    from rollout_engine.core.structured_output import RequestGrammar
    from rollout_engine.engine.detokenizer import StopChecker


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    """Its blocks are allocated and a KV transfer from a prefill engine fills them."""
    FINISHED = "finished"


class Request:
    """A single sequence (one of a prompt's `n` samples) as the scheduler sees it.

    The ledger: `num_tokens` counts prompt + committed output tokens,
    `num_computed_tokens` counts positions whose KV is written or scheduled to be
    written, and `spec_token_ids` are draft tokens proposed for the next step. Under async
    scheduling, `num_output_placeholders` tokens are being sampled by steps in flight.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        group_id: str | None = None,
        sample_index: int = 0,
        grammar: RequestGrammar | None = None,
        stop_checker: StopChecker | None = None,
        bad_words_token_ids: Sequence[Sequence[int]] = (),
        prompt_logprobs_start: int = 0,
        lora_id: int = 0,
    ) -> None:
        assert len(prompt_token_ids) > 0, "a request needs at least one prompt token"
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.group_id = group_id if group_id is not None else request_id
        """Requests sampled from the same prompt share a group (a GRPO group)."""
        self.sample_index = sample_index
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[TopLogprobs] = []
        """With `SamplingParams.logprobs`: one entry per output token."""
        self.output_sampling_masks: list[Sequence[int]] = []
        """With `SamplingParams.return_sampling_mask`: one per output token, the ids its
        distribution kept (int32 arrays)."""
        self.weight_versions: list[WeightVersionSpan] = []
        """Which weight version sampled which output tokens (spans over output indexes)."""
        self.prompt_logprobs_start = prompt_logprobs_start
        """The first prompt position whose logprob is asked for (0: none asked; sample 0 of a
        prompt asks for them). The prefix cache may serve only the positions before the one
        that predicts it."""
        self.prompt_logprobs: list[TopLogprobs | None] | None = (
            [None] * len(prompt_token_ids) if prompt_logprobs_start else None
        )
        """Per prompt position, filled as its prompt's chunks land (position 0 has none)."""
        self.lora_id = lora_id
        """The LoRA adapter it runs under (the engine's id of a loaded adapter; 0: the base
        model): its prefix-cache entries are its adapter's, and a step runs at most
        `max_loras` adapters."""
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        """Draft tokens verified for it so far; `num_accepted_draft_tokens` of them accepted."""
        self.num_accepted_draft_tokens = 0
        self.routed_experts = None
        """MoE models with `enable_return_routed_experts`: the experts of the positions read so
        far (a `RoutedRows`; once finished, every position but the last): a stream's as each
        step lands, another's when it finishes."""
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        """Async scheduling: tokens being sampled by steps in flight, not yet committed. Their
        positions are already counted in `num_computed_tokens` by the steps after them."""
        self.num_cached_tokens: int | None = None
        """Prompt tokens found in the prefix cache when it was first scheduled (vLLM's
        `num_cached_tokens`); None until then, kept across preemption."""
        self.num_steps_in_flight = 0
        """Scheduled steps of this request whose outputs have not landed yet."""
        self.num_preemptions = 0
        self.num_tokens_on_worker = 0
        """How many of `all_token_ids` the worker holds (0: it does not hold the request; see
        `SchedulerOutput.new_requests`)."""
        self.num_blocks_on_worker = 0
        """How many of the request's block ids the worker holds."""
        self.kv_transfer_params = sampling_params.kv_transfer_params
        """Prefill–decode disaggregation: save the prompt's KV when finished
        (`do_remote_decode`), or load it from this handle (`do_remote_prefill`). Set to None
        once a load is done with, whatever its outcome: a request loads at most once."""
        self.kv_transfer_handle: KVTransferParams | None = None
        """Prefill side: the handle of the KV saved when it finished (None if not saved)."""
        self.num_external_computed_tokens = 0
        """Positions whose KV came, or is coming, from a remote engine instead of a forward."""
        self.grammar = grammar
        """Structured outputs: the matcher of the request's constraint."""
        self.stop_checker = stop_checker
        """Stop strings: decodes the output as it grows and finds them. It reads every
        committed token but a stop token (`accept_stop_token`)."""
        self.stop_str: str | None = None
        self.stop_token_id: int | None = None
        """What ended the request, for `CompletionOutput.stop_reason`."""
        self.ended_by_stop_token = False
        """Ended by EOS or a `stop_token_ids` entry (vLLM's `stop_terminated`): that token's
        text is left out of the completion's unless `include_stop_str_in_output`."""
        self.bad_words_token_ids = [list(word) for word in bad_words_token_ids]
        """`SamplingParams.bad_words` as token id sequences (the input processor's)."""
        self.is_dead_ended = False
        """Structured outputs: ended ("abort") because its constraint allowed no token of the
        model's vocabulary at its next position; the engine raises GrammarDeadEndError."""
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def wants_remote_kv(self) -> bool:
        """Decode side of a disaggregated prefill: its prompt's KV is to be loaded."""
        params = self.kv_transfer_params
        return params is not None and params.do_remote_prefill

    @property
    def saves_kv(self) -> bool:
        """Prefill side: its prompt's KV is kept for a decode engine when it finishes."""
        params = self.kv_transfer_params
        return params is not None and params.do_remote_decode

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_prompt_logprobs_missing(self) -> int:
        """Prompt positions whose asked-for logprobs have not landed yet."""
        if not self.prompt_logprobs_start:
            return 0
        return sum(lp is None for lp in self.prompt_logprobs[self.prompt_logprobs_start :])

    @property
    def max_prefix_hit_tokens(self) -> int:
        """Positions the prefix cache may serve: all but the last token, and, while asked-for
        prompt logprobs are missing, only those before the position that predicts the first."""
        if self.num_prompt_logprobs_missing:
            return self.prompt_logprobs_start - 1
        return self.num_tokens - 1

    def append_output_token(
        self, token_id: int, logprob: float | None, top_logprobs: TopLogprobs | None = None
    ) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)

    def append_sampling_masks(self, masks: list[Sequence[int]]) -> None:
        """A landed step's masks, one per token it sampled: those of the tokens it committed
        (the first ones; tokens after a stop were dropped, and so are their masks)."""
        num_new = self.num_output_tokens - len(self.output_sampling_masks)
        self.output_sampling_masks += masks[:num_new]

    def record_weight_version(self, version: int) -> None:
        """The output token just appended was sampled by weight version `version`."""
        index = self.num_output_tokens - 1
        spans = self.weight_versions
        if spans and spans[-1].version == version and spans[-1].end == index:
            spans[-1].end += 1
        else:
            spans.append(WeightVersionSpan(version, index, index + 1, self.lora_id))

    def set_prompt_logprobs(self, first_position: int, entries: list[TopLogprobs]) -> None:
        """Logprobs of prompt positions [first_position, +len(entries)) (recomputed after a
        preemption: the same values again)."""
        assert self.prompt_logprobs is not None
        self.prompt_logprobs[first_position : first_position + len(entries)] = entries

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens}, "
            f"placeholders={self.num_output_placeholders}, spec={self.spec_token_ids})"
        )
