"""The trainer side of colocated RL: a gRPC client for the rollout engine and weight transports.

The types and errors are the engine's own (`rollout_engine.protocol`), re-exported here.
"""

from rollout_engine.protocol import (
    CancelledError,
    CompletionOutput,
    DeadlineExceededError,
    EngineBusyError,
    EngineError,
    EngineInfo,
    EngineSleepingError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    KVTransferError,
    KVTransferParams,
    MemoryState,
    RequestOutput,
    ResourceExhaustedError,
    RoutedExperts,
    SamplingMask,
    SamplingParams,
    ScoreOutput,
    SleepLevel,
    StructuredOutputsParams,
    TopLogprobs,
    UnauthenticatedError,
    UnavailableError,
    WeightVersionSpan,
)
from trainer_bridge.client import EngineClient
from trainer_bridge.disaggregated import DisaggregatedClient
from trainer_bridge.partial_rollouts import PartialRollouts, RolloutBatch, RolloutGroup

__all__ = [
    "CancelledError",
    "CompletionOutput",
    "DeadlineExceededError",
    "DisaggregatedClient",
    "EngineBusyError",
    "EngineClient",
    "EngineError",
    "EngineInfo",
    "EngineSleepingError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "KVTransferError",
    "KVTransferParams",
    "MemoryState",
    "PartialRollouts",
    "RequestOutput",
    "ResourceExhaustedError",
    "RolloutBatch",
    "RolloutGroup",
    "RoutedExperts",
    "SamplingMask",
    "SamplingParams",
    "ScoreOutput",
    "SleepLevel",
    "StructuredOutputsParams",
    "TopLogprobs",
    "UnauthenticatedError",
    "UnavailableError",
    "WeightVersionSpan",
]
