"""What the engine answers: per prompt a RequestOutput with one CompletionOutput per sample
(tokens, logprobs, text, finish reason, weight versions), in one of vLLM's output kinds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from rollout_engine.parsing.messages import ParsedMessage
from rollout_engine.protocol.sampling_mask import SamplingMask
from rollout_engine.protocol.sampling_params import KVTransferParams

FinishReason = Literal["stop", "length", "abort"]

class RequestOutputKind(enum.IntEnum):
    """What the outputs of a prompt carry as it progresses (vLLM's kinds)."""

    CUMULATIVE = 0
    """Every output has every token so far: each costs what was generated so far."""
    DELTA = 1
    """Every output has the tokens (and logprobs) and the text new since the previous one, of
    the samples that have any, or that finished since (streams; vLLM's): text a stop string
    could still cut comes once the sample finished, with its finish reason."""
    FINAL_ONLY = 2
    """One output, when every sample has finished, with all of them (`LLM.generate`,
    GenerateBatch)."""
    DELTA_THEN_WHOLE = 3
    """As DELTA, without text, while a sample runs; the output that finishes it has it whole
    (every token, logprob and its text), as a gRPC Generate stream's last message does."""

@dataclass
class Logprob:
    """One token's entry at a position (vLLM's `Logprob`)."""

    logprob: float
    rank: int
    """1 for the most likely token of the distribution."""


@dataclass
class TopLogprobs:
    """The logprobs returned at one position: the sampled (or, in a prompt, the actual) token
    first, then the most likely tokens, most likely first (the first token may be among them
    again). All of one distribution (see `SamplingParams.logprobs_mode`)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]

    def as_dict(self) -> dict[int, Logprob]:
        """vLLM's form: token id -> Logprob, the first token first."""
        return {t: Logprob(lp, r) for t, lp, r in zip(self.token_ids, self.logprobs, self.ranks)}


@dataclass
class WeightVersionSpan:
    """Output tokens [start, end) of a completion were sampled by weight version `version`,
    under the load `lora_version` of the request's LoRA adapter (`LoadedLoRA.version`; 0: the
    base model). A request keeps its adapter load to the end, an in-place replacement
    included."""

    version: int
    start: int
    end: int
    lora_version: int = 0


@dataclass
class RoutedExperts:
    """The experts MoE tokens were routed to, compactly: [tokens, MoE layers, top_k] as int16
    bytes (little-endian, row-major), in process and over gRPC alike; `to_numpy()` reads it."""

    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, array: np.ndarray) -> RoutedExperts:
        array = np.ascontiguousarray(array, dtype="<i2")
        return cls(list(array.shape), array.tobytes())

    def to_numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype="<i2").reshape(self.shape)


@dataclass
class CompletionOutput:
    """One completion of a prompt."""

    index: int
    """Which of the prompt's `n` samples this is."""
    token_ids: list[int]
    logprobs: list[float]
    """Logprob of each sampled token under the distribution it was sampled from."""
    finish_reason: FinishReason | None = None
    """None while the completion is still being generated."""
    text: str = ""
    weight_version: int = 0
    """The weight version that produced this completion's latest tokens."""
    kv_transfer_params: KVTransferParams | None = None
    """A prefill for a remote decode: the handle of the prompt's KV, to pass to the decode
    engine (None if saving it failed: the decode engine then computes the prompt)."""
    top_logprobs: list[TopLogprobs] | None = None
    """With `SamplingParams.logprobs` set: one entry per token of `token_ids`."""
    stop_str: str | None = None
    """The stop string that ended the completion (finish reason "stop")."""
    stop_token_id: int | None = None
    """The `stop_token_ids` entry that ended the completion (not for EOS)."""
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)
    """Which weight version sampled which output tokens, over the whole completion so far: one
    span unless the request was kept across a weight update (pause or sleep in "keep" mode).
    Each logprob is the one of the weights that sampled its token."""
    num_draft_tokens: int = 0
    """Speculative decoding: draft tokens verified for this completion so far (summed over a
    prompt's samples: the prompt's)."""
    num_accepted_draft_tokens: int = 0
    """Of those, the ones accepted (each a token that cost no step of its own)."""
    routed_experts: RoutedExperts | None = field(default=None, compare=False)
    """MoE models with `enable_return_routed_experts`, once finished: the experts each output
    token was routed to as the model read it, [num_output_tokens - 1, MoE layers, top_k] (the
    last token was never read). In a streamed (DELTA) output: the rows new since the previous
    one (a token's row comes with the token after it); they add up to the finished one's."""
    sampling_mask: SamplingMask | None = None
    """With `SamplingParams.return_sampling_mask`: per token of `token_ids`, the ids its
    sampler's truncation kept (its support), to renormalise a trainer's logprobs over."""
    message: ParsedMessage | None = field(default=None, metadata={"wire": False})
    """`LLM.chat` with a tool or reasoning parser: the assistant message parsed from `text`
    (content, reasoning, tool calls), beside the raw token ids and logprobs. Not sent over
    gRPC: a client parses on its side."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_reason(self) -> int | str | None:
        """vLLM's `stop_reason`: the stop string or stop token id that ended the completion;
        None for EOS, length or abort."""
        return self.stop_str if self.stop_str is not None else self.stop_token_id


@dataclass
class ScoreOutput:
    """The logprobs of one scored sequence's completion part (`score`): no sampling, the
    model's raw distribution."""

    logprobs: list[float]
    """Per completion token: its logprob given everything before it."""
    top_logprobs: list[TopLogprobs] | None = None
    """With `logprobs=k`: per completion token, its entry first, then the k most likely."""
    weight_version: int = 0


@dataclass
class RequestOutput:
    """All completions of one prompt; `outputs[j]` is sample j."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt: str | None = None
    prompt_logprobs: list[TopLogprobs | None] | None = None
    """With `SamplingParams.prompt_logprobs` set: per prompt position, the logprobs of the
    prompt's token there (None for the first); in the first output of a stream."""
    prompt_finished: bool | None = field(default=None, compare=False)
    """Set on DELTA outputs, which leave out the samples without news: whether every sample
    of the prompt has finished. None: `outputs` has every sample and tells."""
    num_cached_tokens: int | None = field(default=None, compare=False)
    """Prompt tokens read from the prefix cache, not computed (vLLM's), when the prompt's
    first sample was first scheduled; None before that (and over gRPC, for now)."""
    prompt_routed_experts: RoutedExperts | None = field(default=None, compare=False)
    """With `enable_return_routed_experts`, once a sample finished: the experts of each prompt
    token, [num_prompt_tokens, MoE layers, top_k] (cached positions included); in a stream, in
    its first output (with the first tokens) only."""

    @property
    def finished(self) -> bool:
        if self.prompt_finished is not None:
            return self.prompt_finished
        return all(o.finished for o in self.outputs)
