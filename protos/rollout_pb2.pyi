from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_STREAM: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC: _ClassVar[Transport]
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_STREAM: Transport
TRANSPORT_SHM: Transport
TRANSPORT_CUDA_IPC: Transport

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed", "stop_token_ids", "ignore_eos", "detokenize", "structured_outputs", "kv_transfer_params", "stop", "include_stop_str_in_output", "min_tokens", "presence_penalty", "frequency_penalty", "logit_bias", "allowed_token_ids", "bad_words", "logprobs", "logprobs_mode", "prompt_logprobs", "truncate_prompt_tokens", "skip_special_tokens", "spaces_between_special_tokens", "kv_keep_alive_s", "return_sampling_mask")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_KEEP_ALIVE_S_FIELD_NUMBER: _ClassVar[int]
    RETURN_SAMPLING_MASK_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    max_tokens: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    detokenize: bool
    structured_outputs: StructuredOutputsParams
    kv_transfer_params: KVTransferParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    logprobs: int
    logprobs_mode: str
    prompt_logprobs: int
    truncate_prompt_tokens: int
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    kv_keep_alive_s: float
    return_sampling_mask: bool
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., detokenize: _Optional[bool] = ..., structured_outputs: _Optional[_Union[StructuredOutputsParams, _Mapping]] = ..., kv_transfer_params: _Optional[_Union[KVTransferParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., logprobs: _Optional[int] = ..., logprobs_mode: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ..., truncate_prompt_tokens: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., kv_keep_alive_s: _Optional[float] = ..., return_sampling_mask: _Optional[bool] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "ranks")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class KVTransferParams(_message.Message):
    __slots__ = ("do_remote_decode", "do_remote_prefill", "transfer_id", "transport", "location", "num_tokens", "prompt_hash", "layout", "weight_version", "weights_fingerprint")
    DO_REMOTE_DECODE_FIELD_NUMBER: _ClassVar[int]
    DO_REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    do_remote_decode: bool
    do_remote_prefill: bool
    transfer_id: str
    transport: str
    location: str
    num_tokens: int
    prompt_hash: str
    layout: str
    weight_version: int
    weights_fingerprint: str
    def __init__(self, do_remote_decode: _Optional[bool] = ..., do_remote_prefill: _Optional[bool] = ..., transfer_id: _Optional[str] = ..., transport: _Optional[str] = ..., location: _Optional[str] = ..., num_tokens: _Optional[int] = ..., prompt_hash: _Optional[str] = ..., layout: _Optional[str] = ..., weight_version: _Optional[int] = ..., weights_fingerprint: _Optional[str] = ...) -> None: ...

class StructuredOutputsParams(_message.Message):
    __slots__ = ("json", "regex", "choice", "grammar", "json_object")
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    json: str
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    grammar: str
    json_object: bool
    def __init__(self, json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class CompletionOutput(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "finish_reason", "text", "weight_version", "kv_transfer_params", "top_logprobs", "stop_str", "stop_token_id", "weight_versions", "num_draft_tokens", "num_accepted_draft_tokens", "routed_experts", "sampling_mask")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_MASK_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    text: str
    weight_version: int
    kv_transfer_params: KVTransferParams
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    stop_str: str
    stop_token_id: int
    weight_versions: _containers.RepeatedCompositeFieldContainer[WeightVersionSpan]
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    routed_experts: RoutedExperts
    sampling_mask: SamplingMask
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., text: _Optional[str] = ..., weight_version: _Optional[int] = ..., kv_transfer_params: _Optional[_Union[KVTransferParams, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., stop_str: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., weight_versions: _Optional[_Iterable[_Union[WeightVersionSpan, _Mapping]]] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_draft_tokens: _Optional[int] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ..., sampling_mask: _Optional[_Union[SamplingMask, _Mapping]] = ...) -> None: ...

class RoutedExperts(_message.Message):
    __slots__ = ("shape", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SamplingMask(_message.Message):
    __slots__ = ("counts", "flat_token_ids")
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    FLAT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    flat_token_ids: bytes
    def __init__(self, counts: _Optional[_Iterable[int]] = ..., flat_token_ids: _Optional[bytes] = ...) -> None: ...

class WeightVersionSpan(_message.Message):
    __slots__ = ("version", "start", "end", "lora_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    LORA_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    start: int
    end: int
    lora_version: int
    def __init__(self, version: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., lora_version: _Optional[int] = ...) -> None: ...

class CompletionDelta(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "top_logprobs", "routed_experts", "sampling_mask")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_MASK_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    routed_experts: RoutedExperts
    sampling_mask: SamplingMask
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ..., sampling_mask: _Optional[_Union[SamplingMask, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "sampling_params", "stream_deltas", "lora_name")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STREAM_DELTAS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    sampling_params: SamplingParams
    stream_deltas: bool
    lora_name: str
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., stream_deltas: _Optional[bool] = ..., lora_name: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "deltas", "outputs", "prompt_logprobs", "num_cached_tokens", "prompt_routed_experts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    deltas: _containers.RepeatedCompositeFieldContainer[CompletionDelta]
    outputs: _containers.RepeatedCompositeFieldContainer[CompletionOutput]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    num_cached_tokens: int
    prompt_routed_experts: RoutedExperts
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., deltas: _Optional[_Iterable[_Union[CompletionDelta, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[CompletionOutput, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., prompt_routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ...) -> None: ...

class GenerateBatchRequest(_message.Message):
    __slots__ = ("prompts", "sampling_params", "per_prompt_sampling_params", "lora_name")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PER_PROMPT_SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling_params: SamplingParams
    per_prompt_sampling_params: _containers.RepeatedCompositeFieldContainer[SamplingParams]
    lora_name: str
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., per_prompt_sampling_params: _Optional[_Iterable[_Union[SamplingParams, _Mapping]]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class BatchCompletion(_message.Message):
    __slots__ = ("prompt_index", "prompt_token_ids", "output", "prompt_logprobs", "num_cached_tokens", "prompt_routed_experts")
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    prompt_index: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output: CompletionOutput
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    num_cached_tokens: int
    prompt_routed_experts: RoutedExperts
    def __init__(self, prompt_index: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output: _Optional[_Union[CompletionOutput, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., prompt_routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ...) -> None: ...

class GenerateBatchResponse(_message.Message):
    __slots__ = ("completions",)
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[BatchCompletion]
    def __init__(self, completions: _Optional[_Iterable[_Union[BatchCompletion, _Mapping]]] = ...) -> None: ...

class RenderChatRequest(_message.Message):
    __slots__ = ("messages_json", "tools_json", "chat_template", "chat_template_kwargs_json", "add_generation_prompt", "continue_final_message", "documents_json", "tokens")
    MESSAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    messages_json: str
    tools_json: str
    chat_template: str
    chat_template_kwargs_json: str
    add_generation_prompt: bool
    continue_final_message: bool
    documents_json: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, messages_json: _Optional[str] = ..., tools_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., chat_template_kwargs_json: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., documents_json: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class RenderChatResponse(_message.Message):
    __slots__ = ("prompt_token_ids", "prompt_text")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("sequences", "prompt_lens", "logprobs")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[TokenIds]
    prompt_lens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., prompt_lens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ...) -> None: ...

class ScoreOutput(_message.Message):
    __slots__ = ("logprobs", "top_logprobs", "weight_version")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    weight_version: int
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[ScoreOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[ScoreOutput, _Mapping]]] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level", "mode")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    level: int
    mode: str
    def __init__(self, level: _Optional[int] = ..., mode: _Optional[str] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("num_aborted_requests", "num_drained_requests", "num_kept_requests")
    NUM_ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAINED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEPT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    num_aborted_requests: int
    num_drained_requests: int
    num_kept_requests: int
    def __init__(self, num_aborted_requests: _Optional[int] = ..., num_drained_requests: _Optional[int] = ..., num_kept_requests: _Optional[int] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode", "clear_cache")
    MODE_FIELD_NUMBER: _ClassVar[int]
    CLEAR_CACHE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    clear_cache: bool
    def __init__(self, mode: _Optional[str] = ..., clear_cache: _Optional[bool] = ...) -> None: ...

class PauseGenerationResponse(_message.Message):
    __slots__ = ("num_aborted_requests", "num_drained_requests", "num_kept_requests")
    NUM_ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAINED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEPT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    num_aborted_requests: int
    num_drained_requests: int
    num_kept_requests: int
    def __init__(self, num_aborted_requests: _Optional[int] = ..., num_drained_requests: _Optional[int] = ..., num_kept_requests: _Optional[int] = ...) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsPausedRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsPausedResponse(_message.Message):
    __slots__ = ("is_paused",)
    IS_PAUSED_FIELD_NUMBER: _ClassVar[int]
    is_paused: bool
    def __init__(self, is_paused: _Optional[bool] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseKVCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseKVCacheResponse(_message.Message):
    __slots__ = ("num_aborted_requests",)
    NUM_ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    num_aborted_requests: int
    def __init__(self, num_aborted_requests: _Optional[int] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("tensors", "transport", "lora")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    transport: Transport
    lora: LoRATarget
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., transport: _Optional[_Union[Transport, str]] = ..., lora: _Optional[_Union[LoRATarget, _Mapping]] = ...) -> None: ...

class LoRATarget(_message.Message):
    __slots__ = ("lora_name", "peft_config_json", "load_inplace")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PEFT_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    LOAD_INPLACE_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    peft_config_json: str
    load_inplace: bool
    def __init__(self, lora_name: _Optional[str] = ..., peft_config_json: _Optional[str] = ..., load_inplace: _Optional[bool] = ...) -> None: ...

class TensorPiece(_message.Message):
    __slots__ = ("name", "tensor_offset", "num_bytes", "buffer_offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor_offset: int
    num_bytes: int
    buffer_offset: int
    def __init__(self, name: _Optional[str] = ..., tensor_offset: _Optional[int] = ..., num_bytes: _Optional[int] = ..., buffer_offset: _Optional[int] = ...) -> None: ...

class StreamChunk(_message.Message):
    __slots__ = ("pieces", "data")
    PIECES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    pieces: _containers.RepeatedCompositeFieldContainer[TensorPiece]
    data: bytes
    def __init__(self, pieces: _Optional[_Iterable[_Union[TensorPiece, _Mapping]]] = ..., data: _Optional[bytes] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "buffer_offset_bytes", "buffer_num_bytes", "device_uuid")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    BUFFER_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    buffer_offset_bytes: int
    buffer_num_bytes: int
    device_uuid: str
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., buffer_offset_bytes: _Optional[int] = ..., buffer_num_bytes: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class SharedBucket(_message.Message):
    __slots__ = ("bucket_id", "shm_name", "cuda_ipc", "pieces")
    BUCKET_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    bucket_id: int
    shm_name: str
    cuda_ipc: CudaIpcHandle
    pieces: _containers.RepeatedCompositeFieldContainer[TensorPiece]
    def __init__(self, bucket_id: _Optional[int] = ..., shm_name: _Optional[str] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., pieces: _Optional[_Iterable[_Union[TensorPiece, _Mapping]]] = ...) -> None: ...

class CommitWeights(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("manifest", "chunk", "bucket", "commit")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    manifest: WeightManifest
    chunk: StreamChunk
    bucket: SharedBucket
    commit: CommitWeights
    def __init__(self, manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[StreamChunk, _Mapping]] = ..., bucket: _Optional[_Union[SharedBucket, _Mapping]] = ..., commit: _Optional[_Union[CommitWeights, _Mapping]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("manifest_accepted", "bucket_done", "weight_version", "lora_adapter")
    MANIFEST_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BUCKET_DONE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    manifest_accepted: bool
    bucket_done: int
    weight_version: int
    lora_adapter: LoRAAdapter
    def __init__(self, manifest_accepted: _Optional[bool] = ..., bucket_done: _Optional[int] = ..., weight_version: _Optional[int] = ..., lora_adapter: _Optional[_Union[LoRAAdapter, _Mapping]] = ...) -> None: ...

class LoRAAdapter(_message.Message):
    __slots__ = ("lora_name", "lora_int_id", "lora_path", "version")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_INT_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_int_id: int
    lora_path: str
    version: int
    def __init__(self, lora_name: _Optional[str] = ..., lora_int_id: _Optional[int] = ..., lora_path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path", "load_inplace")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_INPLACE_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    load_inplace: bool
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., load_inplace: _Optional[bool] = ...) -> None: ...

class LoadLoRAAdapterResponse(_message.Message):
    __slots__ = ("added", "adapter")
    ADDED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    added: bool
    adapter: LoRAAdapter
    def __init__(self, added: _Optional[bool] = ..., adapter: _Optional[_Union[LoRAAdapter, _Mapping]] = ...) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class ListLoRAAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoRAAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class PullKVResponse(_message.Message):
    __slots__ = ("shape", "dtype", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "vocab_size", "max_model_len", "dtype", "device", "weight_version", "config_json", "num_blocks", "num_free_blocks", "num_inflight_requests", "max_inflight_requests", "num_requests_total", "num_generated_tokens_total", "is_sleeping", "weights_valid", "eos_token_ids", "block_size", "engine_stats", "num_unfinished_requests")
    class EngineStatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VALID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STATS_FIELD_NUMBER: _ClassVar[int]
    NUM_UNFINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    dtype: str
    device: str
    weight_version: int
    config_json: str
    num_blocks: int
    num_free_blocks: int
    num_inflight_requests: int
    max_inflight_requests: int
    num_requests_total: int
    num_generated_tokens_total: int
    is_sleeping: bool
    weights_valid: bool
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    engine_stats: _containers.ScalarMap[str, float]
    num_unfinished_requests: int
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., weight_version: _Optional[int] = ..., config_json: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_inflight_requests: _Optional[int] = ..., max_inflight_requests: _Optional[int] = ..., num_requests_total: _Optional[int] = ..., num_generated_tokens_total: _Optional[int] = ..., is_sleeping: _Optional[bool] = ..., weights_valid: _Optional[bool] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., engine_stats: _Optional[_Mapping[str, float]] = ..., num_unfinished_requests: _Optional[int] = ...) -> None: ...

class GetMemoryStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TagMemoryState(_message.Message):
    __slots__ = ("state", "mapped", "num_bytes")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    state: str
    mapped: bool
    num_bytes: int
    def __init__(self, state: _Optional[str] = ..., mapped: _Optional[bool] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class GetMemoryStateResponse(_message.Message):
    __slots__ = ("tags", "pool_bytes", "is_sleeping", "weights_valid", "process_rss_bytes", "device_memory")
    class TagsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TagMemoryState
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TagMemoryState, _Mapping]] = ...) -> None: ...
    class PoolBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DeviceMemoryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TAGS_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VALID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.MessageMap[str, TagMemoryState]
    pool_bytes: _containers.ScalarMap[str, int]
    is_sleeping: bool
    weights_valid: bool
    process_rss_bytes: int
    device_memory: _containers.ScalarMap[str, int]
    def __init__(self, tags: _Optional[_Mapping[str, TagMemoryState]] = ..., pool_bytes: _Optional[_Mapping[str, int]] = ..., is_sleeping: _Optional[bool] = ..., weights_valid: _Optional[bool] = ..., process_rss_bytes: _Optional[int] = ..., device_memory: _Optional[_Mapping[str, int]] = ...) -> None: ...
