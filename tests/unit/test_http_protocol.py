"""The HTTP front-end's pure parts: request bodies with vLLM's fields (refused, ignored,
unknown), their SamplingParams, the status of every engine error, and the config's rules."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollout_engine.config import ServerConfig
from rollout_engine.protocol import (
    ERROR_TYPES,
    AdmissionError,
    EngineBusyError,
    EngineSleepingError,
    InvalidRequestError,
    OutOfBlocksError,
    StepFailedError,
    StructuredOutputsParams,
)
from rollout_engine.server.http.api_models import (
    IGNORED_FIELDS,
    REFUSED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    unknown_fields,
)
from rollout_engine.server.http.error_responses import (
    NotServedHereError,
    RequestTooLargeError,
    UnknownModelError,
    http_status_for,
)
from rollout_engine.server.http.sampling import chat_params, completion_params

MESSAGES = [{"role": "user", "content": "hi"}]


def test_every_vllm_field_is_taken_refused_or_ignored_and_unknown_ones_are_ignored():
    ignored = {"user": "u", "request_id": "r", "session_id": "s", "stream_interval": 4,
               "return_token_offsets": True, "return_mm_kwargs": False}
    CompletionRequest(prompt="x", **ignored)
    ChatCompletionRequest(messages=MESSAGES, parallel_tool_calls=False, include_reasoning=False,
                          **ignored)
    assert set(ignored) == set(IGNORED_FIELDS)  # parallel_tool_calls, include_reasoning: taken
    with pytest.raises(ValidationError, match="beam search is not supported"):
        CompletionRequest(prompt="x", use_beam_search=True)
    CompletionRequest(prompt="x", use_beam_search=False, priority=0)  # defaults are fine
    with pytest.raises(ValidationError, match="priority"):
        ChatCompletionRequest(messages=MESSAGES, priority=1)
    # vLLM accepts and ignores fields it does not know; the server logs their names.
    typo = CompletionRequest(prompt="x", temprature=0.5, stream=True,
                             stream_options={"include_usage": True, "bogus": 1})
    assert typo.temperature is None
    assert unknown_fields(typo) == ["stream_options.bogus", "temprature"]
    with pytest.raises(ValidationError, match="finite number"):  # vLLM: 400 as well
        CompletionRequest(prompt="x", temperature=float("nan"))
    assert set(REFUSED_FIELDS) <= set(ChatCompletionRequest.model_fields) | {
        "suffix", "prompt_embeds"}


def test_sampling_params_take_vllm_defaults_and_rules():
    params = completion_params(CompletionRequest(prompt=[1, 2], top_k=0, logit_bias={"7": 200},
                                                 stop="</a>"), prompt_len=2, max_model_len=64)
    assert (params.top_k, params.logit_bias, params.stop, params.max_tokens) == (
        -1, {7: 100.0}, ["</a>"], 16)
    chat = chat_params(ChatCompletionRequest(messages=MESSAGES, logprobs=True, top_logprobs=3),
                       prompt_len=10, max_model_len=64)
    assert (chat.max_tokens, chat.logprobs) == (54, 3)  # None: the room the model length leaves
    json_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object"}}}
    chat = chat_params(ChatCompletionRequest(messages=MESSAGES, response_format=json_schema),
                       prompt_len=10, max_model_len=64)
    assert chat.structured_outputs == StructuredOutputsParams(json='{"type": "object"}')
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        completion_params(CompletionRequest(prompt=[1], max_tokens=60), prompt_len=10,
                          max_model_len=64)
    with pytest.raises(InvalidRequestError, match="logit_bias keys must be token ids"):
        completion_params(CompletionRequest(prompt=[1], logit_bias={"a": 1}), 1, 64)


def test_every_error_has_its_http_status():
    expected = {
        InvalidRequestError: 400, UnknownModelError: 404, RequestTooLargeError: 413,
        EngineSleepingError: 503, EngineBusyError: 409, AdmissionError: 429,
        OutOfBlocksError: 400, StepFailedError: 500, NotServedHereError: 501,
    }
    for cls, status in expected.items():
        assert http_status_for(cls("x")) == status, cls
    for cls in ERROR_TYPES.values():  # every engine error maps to a real status
        assert 400 <= http_status_for(cls("x")) < 600
    assert http_status_for(RuntimeError("unexpected")) == 500


def test_http_follows_the_loopback_rule_of_grpc():
    ServerConfig(http_port=0)  # loopback: no key needed
    with pytest.raises(ValueError, match="without --api-key"):
        ServerConfig(host="0.0.0.0", auth_token="t", http_port=8000)
    ServerConfig(host="0.0.0.0", auth_token="t", http_port=8000, api_key="k")
    with pytest.raises(ValueError, match="set --http-port too"):
        ServerConfig(api_key="k")
    with pytest.raises(ValueError, match="port of its own"):
        ServerConfig(port=8000, http_port=8000)
