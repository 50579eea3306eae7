"""The typed errors of the engine, each with the gRPC status code it travels as, and the
way back from a status to the same class on the client side."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

ERROR_TYPE_KEY = "rollout-error-type"
"""Trailing metadata of a failed call that names the engine exception behind it."""

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


class LoRAError(InvalidArgumentError):
    """A LoRA adapter was refused: its files, its config (DoRA, modules to save, a bias), a
    module the model has not, a shape that does not fit, a rank above `max_lora_rank`, an
    unknown or reused name or id, or LoRA not enabled."""


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
        EngineSleepingError, EngineBusyError, OutOfBlocksError, AdmissionError,
        DeviceOutOfMemoryError,
        StepFailedError, RankFailedError, KVTransferError, GrammarDeadEndError, LoRAError,
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
