"""The trainer side of colocated RL: a gRPC client for the rollout engine and weight transports."""

from trainer_bridge.client import EngineClient
from trainer_bridge.types import (
    CompletionOutput,
    DeadlineExceededError,
    EngineClientError,
    EngineSleepingError,
    FailedPreconditionError,
    InvalidArgumentError,
    RequestOutput,
    ResourceExhaustedError,
    SamplingParams,
    UnauthenticatedError,
    UnavailableError,
)

__all__ = [
    "CompletionOutput",
    "DeadlineExceededError",
    "EngineClient",
    "EngineClientError",
    "EngineSleepingError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "RequestOutput",
    "ResourceExhaustedError",
    "SamplingParams",
    "UnauthenticatedError",
    "UnavailableError",
]
