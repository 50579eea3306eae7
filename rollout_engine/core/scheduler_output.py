"""What moves between the scheduler and the model runner, one step at a time."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout_engine.protocol import KVTransferParams, SamplingParams

PLACEHOLDER_TOKEN_ID = -1
"""Stands for a token that a step in flight is sampling (async scheduling)."""
NO_ALLOWED_TOKEN_ID = -2
"""The sampler's answer at a position whose grammar bitmask allows no id of the model's
vocabulary (structured outputs): the constraint dead-ended, and there is no token to emit."""


@dataclass
class ScheduledRequest:
    """One request's work in a step, as the model runner needs it."""

    request_id: str
    input_token_ids: list[int]
    """Tokens at positions [start_position, start_position + n), drafts last. With
    `input_from_previous_step` the last one is a placeholder (`PLACEHOLDER_TOKEN_ID`)."""
    start_position: int
    """`num_computed_tokens` before this step: the position of the first input token."""
    block_ids: list[int]
    """The request's whole block table: the KV cache manager's live list, read-only here
    (`KVCacheManager.get_block_ids` says how it changes)."""
    num_spec_tokens: int
    """How many of the input tokens are drafts."""
    needs_sample: bool
    """True when the input reaches the last committed token, so the step yields tokens."""
    sampling_params: SamplingParams
    sample_index: int = 0
    num_output_tokens: int = 0
    """The output index of the first token this step samples: committed output tokens, plus
    the placeholders of steps in flight under async scheduling."""
    input_from_previous_step: bool = False
    """Async scheduling: the last input token is the one the previous step samples for this
    request; the runner reads it on the device (it is not known on the host yet)."""
    num_preemptions: int = 0
    """The request's preemption count when scheduled: an output that lands after a later
    preemption is stale and dropped."""
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    """References to the request's lists (read-only for the runner), for penalties."""


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

    scheduled_requests: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that ended since the last step; the runner drops their state."""
    kv_loads: list[KVLoad] = field(default_factory=list)
    """KV connector metadata: transfers that this step starts. They complete in the
    background; no step reads their blocks before then."""

    @property
    def is_empty(self) -> bool:
        """No positions to compute (KV loads may still have been started)."""
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Per request: the accepted drafts plus one token sampled by the target model."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[float]] | None = None
    """The fp32 logprob of each sampled token under the distribution sampled from."""
