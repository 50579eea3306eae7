"""Result types and exceptions of the client, mirroring the engine's offline API by name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    """How to sample one prompt's completions; the server validates (same names as the engine)."""

    n: int = 1
    """Number of completions per prompt."""
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's."""
    repetition_penalty: float = 1.0
    """>1 discourages tokens already in prompt or output."""
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


@dataclass
class CompletionOutput:
    """One completion of a prompt."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    text: str = ""
    weight_version: int = 0

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


# ------------------------------------------------------------------------------- errors


class EngineClientError(Exception):
    """A call to the engine failed; `code` is the gRPC status code name."""

    code: str = "UNKNOWN"

    def __init__(self, message: str, code: str | None = None, error_type: str = "") -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.error_type = error_type
        """The engine-side exception class name, when the server reported one."""


class InvalidArgumentError(EngineClientError, ValueError):
    """The request was refused as malformed; fix the input and resend."""

    code = "INVALID_ARGUMENT"


class FailedPreconditionError(EngineClientError, RuntimeError):
    """The engine is not in a state to do this (asleep, weights inconsistent)."""

    code = "FAILED_PRECONDITION"


class EngineSleepingError(FailedPreconditionError):
    """Weights or KV cache are asleep; call `wake_up(...)` (and update weights) first."""


class ResourceExhaustedError(EngineClientError, RuntimeError):
    """The server is at its admission limit or the KV pool is too small; retry later."""

    code = "RESOURCE_EXHAUSTED"


class UnavailableError(EngineClientError, ConnectionError):
    """The server cannot be reached or is shutting down."""

    code = "UNAVAILABLE"


class UnauthenticatedError(EngineClientError, PermissionError):
    """The call lacked the server's auth token, or carried a wrong one."""

    code = "UNAUTHENTICATED"


class DeadlineExceededError(EngineClientError, TimeoutError):
    """The call did not finish before its deadline."""

    code = "DEADLINE_EXCEEDED"


ERRORS_BY_CODE: dict[str, type[EngineClientError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        FailedPreconditionError,
        ResourceExhaustedError,
        UnavailableError,
        UnauthenticatedError,
        DeadlineExceededError,
    )
}
