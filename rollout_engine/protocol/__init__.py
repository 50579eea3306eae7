"""Every type and constant both sides of the wire use, defined once. Imports neither torch nor grpc.

The engine (offline `LLM`, the gRPC and HTTP servers) and the trainer side (`trainer_bridge`)
import these, all from here: `from rollout_engine.protocol import SamplingParams, ...`.
One module per concern, as vLLM keeps them apart: `exceptions` (the typed errors and their
gRPC status codes), `sampling_params` (what a request asks for), `outputs` (what the engine
answers), `state` (memory, sleep levels and modes, the engine's facts, wire constants), and
`wire_codec` (these dataclasses to and from their protobuf messages). `protos/rollout.proto`
mirrors the dataclasses field by field; a test reads its descriptor and checks that they agree.
"""

from __future__ import annotations

from rollout_engine.protocol.exceptions import (  # noqa: F401
    ERROR_TYPE_KEY,
    ERROR_TYPES,
    AdmissionError,
    CancelledError,
    DeadlineExceededError,
    DeviceOutOfMemoryError,
    EngineBusyError,
    EngineError,
    EngineSleepingError,
    FailedPreconditionError,
    GrammarDeadEndError,
    InternalError,
    InvalidArgumentError,
    InvalidRequestError,
    KVTransferError,
    LoRAError,
    ModelLoadError,
    OutOfBlocksError,
    RankFailedError,
    ResourceExhaustedError,
    StepFailedError,
    UnauthenticatedError,
    UnavailableError,
    WeightUpdateError,
    error_from_status,
)
from rollout_engine.protocol.lora import LoadedLoRA, LoRARequest  # noqa: F401
from rollout_engine.protocol.outputs import (  # noqa: F401
    CompletionOutput,
    FinishReason,
    Logprob,
    RequestOutput,
    RequestOutputKind,
    RoutedExperts,
    ScoreOutput,
    TopLogprobs,
    WeightVersionSpan,
)
from rollout_engine.protocol.sampling_mask import SamplingMask  # noqa: F401
from rollout_engine.protocol.sampling_params import (  # noqa: F401
    FLOAT32_MAX,
    GREEDY_EPSILON,
    KV_TRANSPORTS,
    LOGPROBS_MODES,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MIN_REPETITION_PENALTY,
    KVTransferParams,
    LogprobsMode,
    SamplingParams,
    StructuredOutputsParams,
)
from rollout_engine.protocol.state import (  # noqa: F401
    DEFAULT_MAX_MESSAGE_BYTES,
    KV_CACHE_TAG,
    LORA_TAG,
    MEMORY_TAGS,
    SERVICE_NAME,
    SLEEP_MODES,
    WEIGHTS_TAG,
    EngineInfo,
    MemoryState,
    PauseMode,
    SleepLevel,
    SleepMode,
    TagMemoryState,
    check_memory_tags,
    check_sleep_mode,
)
