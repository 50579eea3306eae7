"""Every type and constant both sides of the wire use, defined once. Imports neither torch nor grpc.

The engine (offline `LLM`, the gRPC server) and the trainer side (`trainer_bridge`) import
these: sampling parameters, outputs, the typed errors with their gRPC status codes, sleep
levels and modes, the memory state per tag, the engine's facts, and the wire constants.
`protos/rollout.proto` mirrors the dataclasses field by field; a test reads its descriptor
and checks that they agree.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

# ------------------------------------------------------------------------------ constants

SERVICE_NAME = "rollout.v1.RolloutEngine"
"""Full name of the gRPC service (also the health-check service name)."""
ERROR_TYPE_KEY = "rollout-error-type"
"""Trailing metadata of a failed call that names the engine exception behind it."""
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024**2
"""Largest gRPC message either way, by default, on both sides."""

WEIGHTS_TAG = "weights"
KV_CACHE_TAG = "kv_cache"
MEMORY_TAGS: tuple[str, ...] = (WEIGHTS_TAG, KV_CACHE_TAG)
"""The engine's memory pools, in the order they are created and woken."""

FinishReason = Literal["stop", "length", "abort"]
SleepMode = Literal["abort", "wait"]
"""What sleep does to in-flight requests: end them with finish reason "abort", or drain them."""
SLEEP_MODES: tuple[str, ...] = ("abort", "wait")

# Temperatures below this are treated as greedy decoding.
GREEDY_EPSILON = 1e-5


class RequestOutputKind(enum.IntEnum):
    """What the outputs of a prompt carry as it progresses (vLLM's kinds)."""

    CUMULATIVE = 0
    """Every output has every token so far: each costs what was generated so far."""
    DELTA = 1
    """Every output has the tokens (and logprobs) new since the previous one, for every
    sample; a sample's finish reason and text come once, with its last tokens (streams)."""
    FINAL_ONLY = 2
    """One output, when every sample has finished, with all of them (`LLM.generate`,
    GenerateBatch)."""


class SleepLevel(enum.IntEnum):
    """How deeply the engine sleeps (vLLM's levels)."""

    OFFLOAD_WEIGHTS = 1
    """Weights copied to a host backup, KV cache discarded: wake_up() restores them."""
    DISCARD_ALL = 2
    """Weights and KV cache discarded: the weights must be pushed again after wake_up()."""

    @classmethod
    def parse(cls, level: object) -> SleepLevel:
        """The level for 1, 2 or a SleepLevel; InvalidRequestError for anything else."""
        if isinstance(level, int) and not isinstance(level, bool):
            try:
                return cls(level)
            except ValueError:
                pass
        raise InvalidRequestError(
            f"sleep level must be 1 (offload weights to host memory, discard the KV cache) "
            f"or 2 (discard both), got {level!r}"
        )


def check_sleep_mode(mode: object) -> SleepMode:
    if mode not in SLEEP_MODES:
        raise InvalidRequestError(f"sleep mode must be 'abort' or 'wait', got {mode!r}")
    return mode  # type: ignore[return-value]


def check_memory_tags(tags: Sequence[str] | None) -> list[str]:
    """The tags to wake, in pool order (all for None); InvalidRequestError naming the valid ones."""
    if tags is None:
        return list(MEMORY_TAGS)
    if isinstance(tags, str) or not isinstance(tags, Sequence):
        raise InvalidRequestError(
            f"tags must be a list of memory tags such as ['weights'], got {tags!r}; "
            f"valid tags: {list(MEMORY_TAGS)}"
        )
    for tag in tags:
        if tag not in MEMORY_TAGS:
            raise InvalidRequestError(
                f"unknown memory tag {tag!r}; valid tags: {list(MEMORY_TAGS)}"
            )
    return [tag for tag in MEMORY_TAGS if tag in tags]


# --------------------------------------------------------------------------------- errors
# Each class names the gRPC status code it travels as; the server maps `status_code` to the
# code, the client maps the code and ERROR_TYPE_KEY back to the same class. The first level
# under EngineError is one class per status code, so callers can catch by code or by cause.


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""

    status_code: ClassVar[str] = "UNKNOWN"
    """The gRPC status code name (grpc.StatusCode[...]) this error travels as."""

    def __init__(self, message: str = "", *, request_ids: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.request_ids: list[str] = list(request_ids)
        """The requests this error ended (a failed step), if any."""
        self.error_type = type(self).__name__
        """The engine-side class name; on the client, the one the server reported."""

    @property
    def code(self) -> str:
        return self.status_code


class InvalidArgumentError(EngineError, ValueError):
    """The input is wrong; fix it and resend."""

    status_code = "INVALID_ARGUMENT"


class FailedPreconditionError(EngineError, RuntimeError):
    """The engine is not in a state to do this now; change its state (or wait) and retry."""

    status_code = "FAILED_PRECONDITION"


class ResourceExhaustedError(EngineError, RuntimeError):
    """Out of capacity (admission limit, KV pool, device memory); retry later or with less."""

    status_code = "RESOURCE_EXHAUSTED"


class InternalError(EngineError, RuntimeError):
    """The engine failed; the message carries the cause."""

    status_code = "INTERNAL"


class UnavailableError(EngineError, ConnectionError):
    """The server cannot be reached, died, or is shutting down."""

    status_code = "UNAVAILABLE"


class UnauthenticatedError(EngineError, PermissionError):
    """The call lacked the server's auth token, or carried a wrong one."""

    status_code = "UNAUTHENTICATED"


class DeadlineExceededError(EngineError, TimeoutError):
    """The call did not finish before its deadline."""

    status_code = "DEADLINE_EXCEEDED"


class CancelledError(EngineError):
    """The caller cancelled the call (a client-side `CallCancel`, or a closed stream)."""

    status_code = "CANCELLED"


class InvalidRequestError(InvalidArgumentError):
    """The request itself is wrong (prompt, sampling parameters); fix the input and resend."""


class ModelLoadError(InvalidArgumentError):
    """The model directory is missing, unreadable, or holds an unsupported architecture."""


class WeightUpdateError(InvalidArgumentError):
    """A weight update was refused (unknown name, wrong shape or dtype, incomplete)."""


class KVTransferError(InvalidArgumentError):
    """A KV transfer handle this engine cannot use: its role, a layout, model or weight
    version that differs from the prefill engine's, or a prompt that is not the one
    prefilled (prefill–decode disaggregation)."""


class GrammarDeadEndError(InvalidRequestError):
    """A prompt's structured-output constraint allowed no token of the model's vocabulary at
    some position (it needs an id the model cannot emit, such as a token added to the
    tokenizer past the vocabulary); the prompt was ended (`request_ids`). Fix the constraint."""


class EngineSleepingError(FailedPreconditionError):
    """Weights or KV cache are not ready; call `wake_up(...)` (and update weights) first."""


class EngineBusyError(FailedPreconditionError):
    """Refused while requests run or another update took over; retry once they are done."""


class OutOfBlocksError(ResourceExhaustedError):
    """The KV pool is too small for a request even when it runs alone."""


class AdmissionError(ResourceExhaustedError):
    """The server is at its in-flight limit; retry later."""


class DeviceOutOfMemoryError(ResourceExhaustedError):
    """A step ran out of device memory; its requests were ended. Free memory and retry."""


class StepFailedError(InternalError):
    """A step's forward or sampling raised; its requests were ended (`request_ids`)."""


class RankFailedError(StepFailedError):
    """A tensor-parallel rank died, failed or stopped answering; the message names it. The
    engine refuses further work: restart it."""


ERROR_TYPES: dict[str, type[EngineError]] = {
    cls.__name__: cls
    for cls in (
        EngineError, InvalidArgumentError, FailedPreconditionError, ResourceExhaustedError,
        InternalError, UnavailableError, UnauthenticatedError, DeadlineExceededError,
        CancelledError, InvalidRequestError, ModelLoadError, WeightUpdateError,
        EngineSleepingError, EngineBusyError, OutOfBlocksError, AdmissionError, DeviceOutOfMemoryError,
        StepFailedError, RankFailedError, KVTransferError, GrammarDeadEndError,
    )
}
_ERRORS_BY_CODE: dict[str, type[EngineError]] = {
    cls.status_code: cls
    for cls in (
        InvalidArgumentError, FailedPreconditionError, ResourceExhaustedError, InternalError,
        UnavailableError, UnauthenticatedError, DeadlineExceededError, CancelledError,
    )
}


def error_from_status(code: str, message: str, error_type: str = "") -> EngineError:
    """The typed exception for a failed call: the class the server named, if it travels as
    `code`, else the class of the code."""
    cls = ERROR_TYPES.get(error_type)
    if cls is None or cls.status_code != code:
        cls = _ERRORS_BY_CODE.get(code, EngineError)
    error = cls(f"{code}: {message}")
    error.error_type = error_type or cls.__name__
    return error


# ------------------------------------------------------------------------- sampling params


@dataclass
class StructuredOutputsParams:
    """A constraint on a completion (vLLM's names): exactly one of the fields is set.

    The completion ends with finish reason "stop" once the constraint is complete.
    """

    json: str | None = None
    """A JSON Schema (a JSON string; a dict is accepted and serialised)."""
    regex: str | None = None
    """The completion matches this regular expression, whole."""
    choice: list[str] | None = None
    """The completion is one of these strings."""
    grammar: str | None = None
    """A context-free grammar in Lark syntax (llguidance's dialect)."""
    json_object: bool | None = None
    """Any JSON object."""

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        if self.choice is not None:
            self.choice = list(self.choice)
            _check_structured(
                bool(self.choice) and all(isinstance(c, str) and c for c in self.choice),
                f"choice must be a non-empty list of non-empty strings, got {self.choice!r}",
            )
        constraints = [
            name for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        _check_structured(
            len(constraints) == 1,
            f"set exactly one of json, regex, choice, grammar, json_object; got {constraints}",
        )

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)


def _check_structured(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"invalid StructuredOutputsParams: {message}")


KV_TRANSPORTS = ("shm", "grpc", "cuda_ipc")
"""How a prefill engine hands KV to a decode engine: a /dev/shm file on one host, a gRPC
stream from the prefill server (any host), or a CUDA IPC handle (one GPU)."""


@dataclass
class KVTransferParams:
    """Prefill–decode disaggregation (vLLM's `kv_transfer_params`).

    To a prefill engine: `KVTransferParams(do_remote_decode=True)` with `max_tokens=1`; the
    completion comes back with a handle (`CompletionOutput.kv_transfer_params`). To a decode
    engine: that handle, as it is, with the same prompt: the engine loads the prompt's KV
    instead of computing it, and computes it itself if the transfer fails.
    """

    do_remote_decode: bool = False
    """Prefill side: keep this prompt's KV for a decode engine and return a handle."""
    do_remote_prefill: bool = False
    """Decode side: this is a handle; load the KV it names."""
    transfer_id: str = ""
    transport: str = ""
    """One of KV_TRANSPORTS."""
    location: str = ""
    """Where the KV is: the /dev/shm file name, the prefill server's address (grpc), or the
    CUDA IPC handle as JSON."""
    num_tokens: int = 0
    """The leading prompt positions whose KV the handle holds."""
    prompt_hash: str = ""
    """SHA-256 of those positions' token ids: a handle is only used for the same prompt."""
    layout: str = ""
    """The prefill engine's KV layout and model (KVLayout.key): they must match exactly."""
    weight_version: int = 0
    """The weight version that computed the KV: the decode engine's must be the same."""
    weights_fingerprint: str = ""
    """A digest of the weights that computed the KV: the decode engine's must be the same
    (equal versions of two different checkpoints are still refused)."""

    def __post_init__(self) -> None:
        if self.do_remote_decode and self.do_remote_prefill:
            raise InvalidRequestError(
                "kv_transfer_params: set do_remote_decode (to a prefill engine) or "
                "do_remote_prefill (a handle, to a decode engine), not both"
            )
        if self.do_remote_prefill:
            if self.transport not in KV_TRANSPORTS:
                raise InvalidRequestError(
                    f"kv_transfer_params: transport must be one of {KV_TRANSPORTS}, "
                    f"got {self.transport!r}"
                )
            if not self.transfer_id or self.num_tokens < 1:
                raise InvalidRequestError(
                    "kv_transfer_params: a handle needs a transfer_id and num_tokens >= 1 "
                    "(pass the prefill engine's CompletionOutput.kv_transfer_params as it is)"
                )


@dataclass
class SamplingParams:
    """How to sample one prompt's completions (vLLM's names and defaults), validated on
    construction."""

    n: int = 1
    """Number of completions per prompt; they share the prompt's KV blocks."""
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's."""
    repetition_penalty: float = 1.0
    """>1 discourages tokens already in prompt or output (Hugging Face's rule)."""
    max_tokens: int = 16
    """Maximum number of generated tokens per completion."""
    seed: int | None = None
    """Seed of this request's own random stream; None uses the engine's stream."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Tokens that end a completion (kept in the output, finish reason "stop")."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS tokens."""
    detokenize: bool = True
    """Fill `CompletionOutput.text` when a completion finishes."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the completions (JSON Schema, regex, choice, grammar); None: free text."""
    kv_transfer_params: KVTransferParams | None = None
    """Prefill–decode disaggregation: save the prompt's KV for a decode engine, or load it
    from a prefill engine's handle (see KVTransferParams)."""

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids)
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be >= 1, got {self.n!r}")
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            f"max_tokens must be >= 1, got {self.max_tokens!r}",
        )
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            f"top_k must be -1 (off) or >= 1, got {self.top_k!r}",
        )
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}",
        )
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams or None",
        )
        kv = self.kv_transfer_params
        _check(
            kv is None or isinstance(kv, KVTransferParams),
            "kv_transfer_params must be a KVTransferParams or None",
        )
        _check(
            kv is None or not kv.do_remote_decode or self.n == 1,
            f"a prefill for a remote decode (do_remote_decode) samples n=1, got n={self.n}",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"invalid SamplingParams: {message}")


# -------------------------------------------------------------------------------- outputs


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
    """The weight version that produced this completion."""
    kv_transfer_params: KVTransferParams | None = None
    """A prefill for a remote decode: the handle of the prompt's KV, to pass to the decode
    engine (None if saving it failed: the decode engine then computes the prompt)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All completions of one prompt; `outputs[j]` is sample j."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt: str | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


# ----------------------------------------------------------------------- memory and facts


@dataclass(frozen=True)
class TagMemoryState:
    """One memory pool as the user sees it."""

    state: str
    """"awake", "offloaded" (contents in a host backup) or "discarded" (contents lost)."""
    mapped: bool
    """Whether physical memory backs the pool right now."""
    num_bytes: int
    """Capacity of the pool."""


@dataclass(frozen=True)
class MemoryState:
    """A snapshot of the engine's memory, as `memory_state()` returns it."""

    tags: dict[str, TagMemoryState]
    pool_bytes: dict[str, int]
    """Capacity of each pool, by tag."""
    is_sleeping: bool
    """True while any pool's memory is released."""
    weights_valid: bool
    """False after sleep(level=2) and during (or after a cut-off) weight update."""
    process_rss_bytes: int
    """Resident memory of the engine process."""
    device_memory: dict[str, int] = field(default_factory=dict)
    """{"device_used_bytes", "device_total_bytes"} on CUDA, empty on CPU."""


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is and how it is doing: model, limits, KV blocks, counters."""

    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    dtype: str
    """torch dtype name without "torch.", e.g. "bfloat16"."""
    device: str
    weight_version: int
    config_json: str
    """The EngineConfig as JSON, grouped by concern."""
    num_blocks: int
    num_free_blocks: int
    block_size: int
    eos_token_ids: list[int]
    is_sleeping: bool
    weights_valid: bool
    engine_stats: dict[str, float] = field(default_factory=dict)
    """Preemptions, prefix-cache hits, speculative decoding (spec_acceptance_rate, ...)."""
    num_unfinished_requests: int = 0
    """Prompts the engine holds (running or waiting)."""
    num_inflight_requests: int = 0
    """Server: samples admitted and not yet answered."""
    max_inflight_requests: int = 0
    """Server: the admission limit, in samples."""
    num_requests_total: int = 0
    """Server: prompts added since start."""
    num_generated_tokens_total: int = 0
    """Server: tokens of finished completions since start."""

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json or "{}")
