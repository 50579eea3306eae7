"""The client's side of the wire: prompts, sampling parameters and Score requests to messages,
messages back to outputs (a Generate stream's deltas applied to its snapshot), and a failed
call's status back to the engine's typed error."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from protos import rollout_pb2 as pb
from rollout_engine.protocol import (
    ERROR_TYPE_KEY,
    MAX_LOGPROBS,
    CompletionOutput,
    EngineError,
    InvalidRequestError,
    LoadedLoRA,
    RequestOutput,
    RoutedExperts,
    SamplingMask,
    SamplingParams,
    TopLogprobs,
    error_from_status,
)
from rollout_engine.protocol.wire_codec import from_message, to_message

Prompt = str | Sequence[int]


def error_from_rpc(exc: grpc.RpcError) -> EngineError:
    """The typed exception for a failed call (status code, plus the engine's error type)."""
    code = exc.code().name if exc.code() is not None else "UNKNOWN"
    error_type = ""
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_TYPE_KEY:
            error_type = value
    return error_from_status(code, exc.details() or "", error_type)


def per_prompt(
    prompts: Prompt | Sequence[Prompt],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
) -> tuple[list[Prompt], list[SamplingParams]]:
    """A prompt or a list of them, and one SamplingParams for all or one per prompt, as two
    lists of the same length."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    prompts = list(prompts)
    if isinstance(sampling_params, Sequence):
        params = list(sampling_params)
    else:
        params = [sampling_params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    return prompts, params


def prompt_proto(prompt: Prompt) -> pb.Prompt:
    if isinstance(prompt, str):
        return pb.Prompt(text=prompt)
    return pb.Prompt(token_ids=pb.TokenIds(token_ids=[int(t) for t in prompt]))


def params_proto(params: SamplingParams | None) -> pb.SamplingParams:
    """None: every field unset, so the server applies its defaults."""
    return pb.SamplingParams() if params is None else to_message(params, pb.SamplingParams())


def completion_from_proto(message: pb.CompletionOutput) -> CompletionOutput:
    return from_message(message, CompletionOutput)


def prompt_logprobs_from_proto(entries: Sequence[pb.TopLogprobs]) -> list[TopLogprobs | None]:
    """Per prompt position; an empty entry (the first position) is None."""
    return [from_message(e, TopLogprobs) if e.token_ids else None for e in entries]


def score_request_proto(
    sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], logprobs: int | None
) -> pb.ScoreRequest:
    """The message; values the wire cannot carry (negative, not ints) are refused here, the
    rest by the server."""
    values = [*prompt_lens, *([] if logprobs is None else [logprobs])]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise InvalidRequestError(
            f"prompt_lens must be ints >= 1 and logprobs None or in [0, {MAX_LOGPROBS}]; got "
            f"prompt_lens={list(prompt_lens)!r}, logprobs={logprobs!r}"
        )
    request = pb.ScoreRequest(
        sequences=[pb.TokenIds(token_ids=[int(t) for t in s]) for s in sequences],
        prompt_lens=list(prompt_lens),
    )
    if logprobs is not None:
        request.logprobs = logprobs
    return request


def apply_generate_response(snapshot: RequestOutput, message: pb.GenerateResponse) -> None:
    snapshot.request_id = message.request_id or snapshot.request_id
    snapshot.prompt_token_ids.extend(message.prompt_token_ids)
    if message.prompt_logprobs:
        snapshot.prompt_logprobs = prompt_logprobs_from_proto(message.prompt_logprobs)
    if message.HasField("num_cached_tokens"):
        snapshot.num_cached_tokens = message.num_cached_tokens
    if message.HasField("prompt_routed_experts"):
        snapshot.prompt_routed_experts = from_message(message.prompt_routed_experts,
                                                      RoutedExperts)
    by_index = {o.index: o for o in snapshot.outputs}
    for delta in message.deltas:
        output = by_index.get(delta.index)
        if output is None:
            output = by_index[delta.index] = CompletionOutput(delta.index, [], [])
            snapshot.outputs.append(output)
        output.token_ids.extend(delta.token_ids)
        output.logprobs.extend(delta.logprobs)
        if delta.top_logprobs:
            output.top_logprobs = (output.top_logprobs or []) + [
                from_message(e, TopLogprobs) for e in delta.top_logprobs
            ]
        if delta.HasField("routed_experts"):
            output.routed_experts = _extended(output.routed_experts, delta.routed_experts)
        if delta.HasField("sampling_mask"):
            output.sampling_mask = SamplingMask.concat(
                [output.sampling_mask, from_message(delta.sampling_mask, SamplingMask)])
    for final in message.outputs:
        if final.index in by_index:
            snapshot.outputs.remove(by_index[final.index])
        snapshot.outputs.append(completion_from_proto(final))
    snapshot.outputs.sort(key=lambda o: o.index)


def _extended(rows: RoutedExperts | None, delta: pb.RoutedExperts) -> RoutedExperts:
    """A stream's rows so far with a delta's appended (rows of the same layers and top_k)."""
    new = from_message(delta, RoutedExperts)
    if rows is None:
        return new
    return RoutedExperts([rows.shape[0] + new.shape[0], *rows.shape[1:]], rows.data + new.data)


def lora_from_proto(message: pb.LoRAAdapter) -> LoadedLoRA:
    return LoadedLoRA(message.lora_name, int(message.lora_int_id), message.lora_path,
                      int(message.version))


def peft_config_json(peft_config: Mapping[str, Any] | Any) -> str:
    """A PEFT config (a LoraConfig, or adapter_config.json's dict) as the JSON object the
    server reads: sets (target_modules) as sorted lists, enums by value."""
    config = peft_config.to_dict() if hasattr(peft_config, "to_dict") else dict(peft_config)

    def jsonable(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        if isinstance(value, enum.Enum):
            return value.value
        raise TypeError(f"{type(value).__name__} in a PEFT config is not JSON")

    return json.dumps(config, default=jsonable)
