"""A rollout engine for RL post-training: paged KV cache, continuous batching, prefix caching.

`import rollout_engine` stays torch-free: it gives the shared types of `rollout_engine.protocol`;
`LLM` and `LLMEngine` (which need torch) are imported on first use.
"""

from typing import TYPE_CHECKING

from rollout_engine.protocol import (
    CompletionOutput,
    DeviceOutOfMemoryError,
    EngineBusyError,
    EngineError,
    EngineInfo,
    EngineSleepingError,
    GrammarDeadEndError,
    InvalidRequestError,
    KVTransferError,
    KVTransferParams,
    LoRAError,
    LoRARequest,
    MemoryState,
    ModelLoadError,
    OutOfBlocksError,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    ScoreOutput,
    SleepLevel,
    StepFailedError,
    StructuredOutputsParams,
    TopLogprobs,
    WeightUpdateError,
)

if TYPE_CHECKING:
    from rollout_engine.engine.llm_engine import LLMEngine
    from rollout_engine.llm import LLM

__all__ = [
    "LLM",
    "CompletionOutput",
    "DeviceOutOfMemoryError",
    "EngineBusyError",
    "EngineError",
    "EngineInfo",
    "EngineSleepingError",
    "GrammarDeadEndError",
    "InvalidRequestError",
    "KVTransferError",
    "KVTransferParams",
    "LLMEngine",
    "LoRAError",
    "LoRARequest",
    "MemoryState",
    "ModelLoadError",
    "OutOfBlocksError",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoreOutput",
    "SleepLevel",
    "StepFailedError",
    "StructuredOutputsParams",
    "TopLogprobs",
    "WeightUpdateError",
]


def __getattr__(name: str):
    if name == "LLM":
        from rollout_engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from rollout_engine.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'rollout_engine' has no attribute {name!r}")
