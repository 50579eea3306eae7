"""A rollout engine for RL post-training: paged KV cache, continuous batching, prefix caching."""

from rollout_engine.errors import (
    EngineError,
    EngineSleepingError,
    InvalidRequestError,
    ModelLoadError,
    OutOfBlocksError,
    WeightUpdateError,
)
from rollout_engine.outputs import CompletionOutput, RequestOutput
from rollout_engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineError",
    "EngineSleepingError",
    "InvalidRequestError",
    "ModelLoadError",
    "OutOfBlocksError",
    "WeightUpdateError",
]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; keep `import rollout_engine` light for the scheduler.
    if name == "LLM":
        from rollout_engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from rollout_engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'rollout_engine' has no attribute {name!r}")
