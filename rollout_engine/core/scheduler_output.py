"""What moves between the scheduler and the model runner, one step at a time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rollout_engine.protocol import KVTransferParams, SamplingParams, TopLogprobs

PLACEHOLDER_TOKEN_ID = -1
"""Stands for a token that a step in flight is sampling (async scheduling)."""
NO_ALLOWED_TOKEN_ID = -2
"""The sampler's answer at a position whose grammar bitmask allows no id of the model's
vocabulary (structured outputs): the constraint dead-ended, and there is no token to emit."""


@dataclass(frozen=True)
class NewRequestData:
    """A request the worker does not hold: sent once when it is first scheduled, and again
    when it resumes after a preemption (the worker dropped it then). Everything after that
    comes as a `ScheduledRequest` delta."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Its committed output tokens: empty for a new request, what it had generated for a
    resumed one (its KV is recomputed over prompt and output)."""
    sampling_params: SamplingParams
    sample_index: int
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    """`SamplingParams.bad_words` as token id sequences (tokenized by the engine)."""
    prompt_logprobs_start: int = 0
    """The first prompt position whose logprob the worker computes (0: none)."""
    lora_id: int = 0
    """The LoRA adapter it runs under (the engine's id of a loaded adapter; 0: the base)."""


@dataclass
class ScheduledRequest:
    """One request's share of a step: the delta since the worker last heard of it.

    The worker keeps each request's tokens and block table (`worker.persistent_batch`); a
    step sends what is new, so its size does not grow with what was generated before.
    """

    request_id: str
    start_position: int
    """`num_computed_tokens` before this step: the position of the first input token."""
    num_tokens: int
    """Positions this step computes, drafts included."""
    new_token_ids: list[int]
    """Committed tokens the worker has not been sent (for a request already held: those
    sampled since it was last scheduled; empty for a new or resumed one, whose tokens come
    in `NewRequestData`)."""
    new_block_ids: list[int]
    """KV blocks allocated since the worker last heard (all of them for a new request)."""
    spec_token_ids: list[int]
    """Drafts to verify: the step's last input tokens."""
    needs_sample: bool
    """True when the input reaches the last committed token, so the step yields tokens."""
    num_output_tokens: int = 0
    """The output index of the first token this step samples: committed output tokens, plus
    the placeholders of steps in flight under async scheduling."""
    input_from_previous_step: bool = False
    """Async scheduling: the only input token is the one the previous step samples for this
    request; the runner reads it on the device (it is not known on the host yet)."""
    num_preemptions: int = 0
    """The request's preemption count when scheduled: an output that lands after a later
    preemption is stale and dropped."""

    @property
    def num_spec_tokens(self) -> int:
        """How many of the input tokens are drafts."""
        return len(self.spec_token_ids)


@dataclass(frozen=True)
class KVLoad:
    """A KV transfer to start: the handle's KV for positions [start_position,
    start_position + num_tokens) goes into the request's blocks (prefill–decode
    disaggregation). The blocks are not in the prefix cache until the load completes."""

    request_id: str
    params: KVTransferParams
    block_ids: tuple[int, ...]
    start_position: int
    """Positions before it are local prefix-cache hits: a multiple of the block size."""
    num_tokens: int


@dataclass
class SchedulerOutput:
    """Everything the model runner needs for one step; the scheduler's only message to it."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    """Requests the worker starts holding this step (new, or resumed after preemption)."""
    scheduled_requests: list[ScheduledRequest] = field(default_factory=list)
    """The step's batch, in order: one delta per request."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    """Requests preempted by recompute this step; the worker drops them (they come back as
    `NewRequestData`)."""
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that ended since the last step; the worker drops them."""
    kv_loads: list[KVLoad] = field(default_factory=list)
    """KV connector metadata: transfers that this step starts. They complete in the
    background; no step reads their blocks before then."""

    @property
    def is_empty(self) -> bool:
        """No positions to compute (KV loads may still have been started)."""
        return self.total_num_scheduled_tokens == 0

    @property
    def drops_requests(self) -> bool:
        """It tells the worker to forget requests (an empty step must still deliver it)."""
        return bool(self.finished_request_ids or self.preempted_request_ids)


@dataclass
class ModelRunnerOutput:
    """Per request: the accepted drafts plus one token sampled by the target model."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[float]] | None = None
    """The fp32 logprob of each sampled token under the distribution sampled from."""
    top_logprobs: dict[str, list[TopLogprobs]] = field(default_factory=dict)
    """Requests with `SamplingParams.logprobs`: one entry per sampled token."""
    sampling_masks: dict[str, list[Sequence[int]]] = field(default_factory=dict)
    """Requests with `SamplingParams.return_sampling_mask`: per sampled token, the ids its
    distribution kept (int32 arrays)."""
    prompt_logprobs: dict[str, tuple[int, list[TopLogprobs]]] = field(default_factory=dict)
    """Requests with prompt logprobs: (first prompt position, one entry per position from it)
    for the positions this step computed."""
