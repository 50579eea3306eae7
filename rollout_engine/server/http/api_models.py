"""The request bodies of `vllm serve`'s API, field for field with vLLM's names and defaults
(`vllm/entrypoints/openai/{completion,chat_completion}/protocol.py`).

Every field vLLM takes is declared. Those this engine cannot honour are refused when set to
anything but their default (`REFUSED_FIELDS`, with the reason the error gives); a few are
accepted and have no effect here (`IGNORED_FIELDS`). A field vLLM does not know is accepted and
ignored, as vLLM does: OpenAI's clients send fields of their own (`metadata`, `store`,
`service_tier`, ...) that no server of this API honours. What was ignored is logged once per
request (`unknown_fields`), so a misspelt sampling field (`temprature`) is seen in the log.

Responses are built as plain dicts in `responses.py`, in the shapes vLLM's response models
serialise to.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]
TokenId = Annotated[int, Field(ge=0)]

REFUSED_FIELDS: dict[str, str] = {
    "suffix": "suffixes are not supported (as in vLLM)",
    "use_beam_search": "beam search is not supported; sample n completions instead",
    "watermarking": "watermarking is not supported",
    "logprob_token_ids": "logprobs of chosen token ids are not supported; use logprobs=k",
    "prompt_embeds": "prompt embeddings are not supported; send text or token ids",
    "cache_salt": "prefix-cache salting is not supported",
    "kv_transfer_params": "prefill-decode KV transfers go over gRPC (trainer_bridge)",
    "ec_transfer_params": "encoder-cache transfers are not supported",
    "vllm_xargs": "custom extension arguments are not supported",
    "repetition_detection": "repetition detection is not supported",
    "thinking_token_budget": "thinking budgets are not supported",
    "priority": "priority scheduling is not supported; send priority 0",
    "length_penalty": "length_penalty applies to beam search only, which is not supported",
    "media_io_kwargs": "multimodal inputs are not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported",
}
"""Fields refused unless left at their default, and why."""
IGNORED_FIELDS: tuple[str, ...] = (
    "user", "request_id", "session_id", "stream_interval", "return_token_offsets",
    "return_mm_kwargs",
)
"""Accepted and without effect: identities, and output shaping this server has no use for."""


class VllmRequest(BaseModel):
    """A request body: unknown fields are kept aside (`model_extra`) and ignored; refused
    fields must keep their defaults."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    refused: ClassVar[dict[str, str]] = REFUSED_FIELDS

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> VllmRequest:
        for name in self.model_fields_set & set(self.refused):
            if getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(f"`{name}` is not supported by this server: {self.refused[name]}")
        return self


class StreamOptions(VllmRequest):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class StructuredOutputsRequest(VllmRequest):
    """vLLM's `StructuredOutputsParams` as JSON: exactly one constraint."""

    refused: ClassVar[dict[str, str]] = {
        name: "this structured-outputs option is not supported (llguidance compiles the "
              "constraint as given)"
        for name in ("disable_fallback", "disable_any_whitespace",
                     "disable_additional_properties", "whitespace_pattern", "structural_tag")
    }
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(VllmRequest):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)


class ResponseFormat(VllmRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(VllmRequest):
    """The fields `/v1/completions` and `/v1/chat/completions` share (vLLM's order)."""

    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    presence_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[TokenId] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[TokenId] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    # vLLM's extra parameters
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    priority: Int64 = 0
    request_id: str | None = None
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    routed_experts_prompt_start: Annotated[int, Field(ge=0)] = 0
    """With `serve --enable-return-routed-experts`: the prompt rows `routed_experts` skips."""
    return_token_offsets: bool | None = False
    return_mm_kwargs: bool = True
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None
    # this server's: multi-turn rollouts keep a finished turn's KV for the next one
    kv_keep_alive_s: Annotated[float, Field(ge=0)] = 0.0


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    prompt: (list[TokenId] | list[list[TokenId]] | str | list[str])
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    prompt_embeds: bytes | list[bytes] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_stream_fields(self) -> CompletionRequest:
        _check_stream_options(self)
        return self


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh",
                              "max"] | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None

    @model_validator(mode="after")
    def _check_stream_fields(self) -> ChatCompletionRequest:
        _check_stream_options(self)
        return self


class TokenizeCompletionRequest(VllmRequest):
    """`POST /tokenize` with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenChatCompletionRequest(ChatCompletionRequest):
    """`POST /v1/chat/completions/tokens` (prime-rl's): a chat request and `tokens`, the
    previous turn's prompt and completion ids; the prompt extends them (token in)."""

    tokens: Annotated[list[int], Field(min_length=1)]


class TokenizeChatRequest(VllmRequest):
    """`POST /tokenize` with messages: the prompt the chat template renders."""

    model: str | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, str]] | None = None
    return_token_strs: bool | None = False
    reasoning_effort: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(VllmRequest):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[TokenId]


def _check_stream_options(request: SamplingFields) -> None:
    if request.stream_options is not None and not request.stream:
        raise ValueError("stream_options can only be set when stream is true")
    if request.stream and request.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs are not available when stream is true")


def unknown_fields(request: BaseModel, prefix: str = "") -> list[str]:
    """The fields of a parsed body, nested ones included (`stream_options.x`), that no model
    declares: accepted and ignored."""
    names = [prefix + name for name in request.model_extra or {}]
    for name in request.model_fields_set:
        value = getattr(request, name, None)
        if isinstance(value, BaseModel):
            names += unknown_fields(value, f"{prefix}{name}.")
    return sorted(names)
