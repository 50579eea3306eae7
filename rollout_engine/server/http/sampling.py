"""From a request body to the engine's SamplingParams, with vLLM's defaults and rules: top_k 0
means off, max_tokens None means the room the model length leaves, a prompt with its
completion must fit the model length, response_format is a structured-outputs constraint."""

from __future__ import annotations

import json
from typing import Any

from rollout_engine.protocol import (
    MAX_LOGPROBS,
    InvalidRequestError,
    SamplingParams,
    StructuredOutputsParams,
)
from rollout_engine.server.http.api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)

# vLLM's defaults when a field is null (`_DEFAULT_SAMPLING_PARAMS`).
_DEFAULTS = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
             "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def completion_params(request: CompletionRequest, prompt_len: int, max_model_len: int
                      ) -> SamplingParams:
    """One prompt's SamplingParams for `/v1/completions`. With `echo`, the prompt's logprobs
    come back too (vLLM asks for them with the same k); `max_tokens=0` with `echo` returns the
    prompt alone (one token is generated and dropped)."""
    echo_only = bool(request.echo) and request.max_tokens == 0
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and request.echo:
        prompt_logprobs = request.logprobs
    max_tokens = 1 if echo_only else request.max_tokens
    return _params(request, prompt_len, max_model_len, max_tokens=max_tokens,
                   logprobs=request.logprobs, prompt_logprobs=prompt_logprobs)


def chat_params(request: ChatCompletionRequest, prompt_len: int, max_model_len: int
                ) -> SamplingParams:
    """SamplingParams for `/v1/chat/completions`: `top_logprobs` is k when `logprobs` is true."""
    max_tokens = (request.max_completion_tokens if request.max_completion_tokens is not None
                  else request.max_tokens)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and request.echo and request.logprobs:
        prompt_logprobs = request.top_logprobs
    return _params(request, prompt_len, max_model_len, max_tokens=max_tokens,
                   logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def _params(request: SamplingFields, prompt_len: int, max_model_len: int, *,
            max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
            ) -> SamplingParams:
    values = {name: default if getattr(request, name) is None else getattr(request, name)
              for name, default in _DEFAULTS.items()}
    if values["top_k"] == 0:
        values["top_k"] = -1  # vLLM's 0 and -1 both mean "off"; the engine takes -1
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value == -1:
            raise InvalidRequestError(f"{name}=-1 (the whole vocabulary) is not supported; "
                                      f"ask for at most {MAX_LOGPROBS}")
    if request.truncation_side == "right":
        raise InvalidRequestError("truncation_side 'right' is not supported: truncation keeps "
                                  "the prompt's last tokens ('left')")
    truncate = request.truncate_prompt_tokens
    if truncate == -1:
        truncate = max_model_len
    if truncate is not None:
        prompt_len = min(prompt_len, truncate)
    return SamplingParams(
        n=request.n,
        **values,
        max_tokens=resolve_max_tokens(max_tokens, prompt_len, max_model_len),
        seed=request.seed,
        stop=_stop_strings(request.stop),
        stop_token_ids=list(request.stop_token_ids or []),
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        truncate_prompt_tokens=truncate,
        allowed_token_ids=request.allowed_token_ids,
        bad_words=list(request.bad_words or []),
        logit_bias=_logit_bias(request.logit_bias),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured_outputs(request),
        kv_keep_alive_s=request.kv_keep_alive_s,
    )


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """vLLM's rule: the prompt and its completion fit the model length; None takes the room."""
    room = max_model_len - prompt_len
    if room < 1:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens and the prompt has "
            f"{prompt_len}: shorten the prompt to leave room for at least one new token")
    if requested is None:
        return room
    if requested > room:
        raise InvalidRequestError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's "
            f"maximum context length is {max_model_len} tokens and your request has "
            f"{prompt_len} input tokens ({requested} > {max_model_len} - {prompt_len})")
    return requested


def structured_outputs(request: SamplingFields) -> StructuredOutputsParams | None:
    """`structured_outputs`, else the constraint `response_format` names (vLLM's precedence)."""
    so = request.structured_outputs
    if so is not None:
        fields: dict[str, Any] = {"json": so.json_, "regex": so.regex, "choice": so.choice,
                                  "grammar": so.grammar, "json_object": so.json_object}
        return StructuredOutputsParams(**{k: v for k, v in fields.items() if v is not None})
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    schema = response_format.json_schema
    if schema is None or schema.schema_ is None:
        raise InvalidRequestError("response_format of type 'json_schema' needs "
                                  "json_schema.schema")
    return StructuredOutputsParams(json=json.dumps(schema.schema_))


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI sends token ids as JSON keys (strings)."""
    result = {}
    for key, value in (bias or {}).items():
        try:
            result[int(key)] = value
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {key!r}") from None
    return result
