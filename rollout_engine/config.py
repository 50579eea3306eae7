"""Engine configuration: one frozen dataclass per concern, grouped in `EngineConfig`.

Values discovered at run time (number of KV blocks, model length, EOS ids) live in
`RuntimeLimits`, never written back into these configs.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from rollout_engine.protocol import DEFAULT_MAX_MESSAGE_BYTES, KV_TRANSPORTS

DType = Literal["auto", "float32", "float16", "bfloat16"]
ModelImpl = Literal["auto", "native", "transformers"]
MODEL_IMPLS: tuple[str, ...] = ("auto", "native", "transformers")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and where to run it."""

    model: str
    """Path to a Hugging Face model directory (config.json + safetensors + tokenizer)."""
    dtype: DType = "auto"
    """Weight/activation dtype; "auto" takes the checkpoint's `torch_dtype` (on the CPU: bfloat16
    only where the CPU computes in it, float32 otherwise; see `loader.resolve_dtype`)."""
    device: str = "cpu"
    """Torch device string: "cpu" or "cuda[:i]"."""
    seed: int = 0
    """Seed of the engine's random stream (requests without their own seed use it)."""
    cpu_threads: int | None = None
    """CPU only: OpenMP threads of the engine's forward (set for each step, and the caller's
    `torch.get_num_threads()` put back after it). None: the usable cores that other processes
    leave free, re-checked every half second (see `worker/cpu_threads.py`): threads that
    share a core with another busy process make every parallel region wait."""
    cpu_packed_weights: bool = True
    """CPU only: run the linear layers through oneDNN on packed copies of their weights
    (1.3-2x faster on decode-sized GEMMs; see `worker/models/packed_linear.py`). The copies
    take as much memory again as the linear weights while the engine is awake, and are
    dropped at sleep and after weight updates. False: `F.linear` on the weights themselves."""
    model_impl: ModelImpl = "auto"
    """Which modeling code runs the checkpoint: "native" (our decoder: Llama, Qwen2, Qwen3),
    "transformers" (Hugging Face's modeling code with our paged attention plugged in, for
    any decoder-only `*ForCausalLM` whose attention goes through transformers'
    `AttentionInterface`), or "auto" (native where it exists, else transformers)."""
    batch_invariant: bool = False
    """Every step in `rollout_engine.batch_invariant`'s mode: linear layers and attention whose
    bits do not depend on the batch, the chunking or the prefix cache, so a token's logprob
    equals what a trainer computes under `set_batch_invariant_mode()`. CPU (the linears packed
    for the batch-invariant GEMM, not oneDNN, whose GEMMs reduce by shape) or CUDA (Triton
    kernels, no CUDA graphs so far)."""
    cuda_graphs: bool = False
    """Replay plain decode steps from CUDA graphs, one per batch-size bucket (vLLM's
    default; its `enforce_eager` turns them off). Off by default until a GPU run has shown
    greedy parity with and without them. On the CPU the same padded path runs eagerly."""
    enable_return_routed_experts: bool = False
    """MoE models (vLLM's name): return the experts each token was routed to
    (`CompletionOutput.routed_experts`, `RequestOutput.prompt_routed_experts`), kept beside
    the KV so that prefix-cache hits and recomputed tokens report them too."""
    return_sampling_mask: bool = False
    """vLLM's engine-wide switch: every request returns its sampling masks, as if its
    `SamplingParams.return_sampling_mask` were set (one that truncates nothing is refused)."""

    def __post_init__(self) -> None:
        _require(bool(self.model), "model must be a model directory path")
        _require(self.dtype in ("auto", "float32", "float16", "bfloat16"),
                 f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        _require(self.model_impl in MODEL_IMPLS,
                 f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        _require(not self.batch_invariant or (self.device.split(":")[0] in ("cpu", "cuda")
                                              and not self.cuda_graphs),
                 "batch_invariant runs on the CPU or CUDA, without CUDA graphs so far")
        _require(self.cpu_threads is None or self.cpu_threads >= 1,
                 f"cpu_threads must be >= 1 or None, got {self.cpu_threads}")


@dataclass(frozen=True)
class SchedulerConfig:
    """The token ledger's limits (see DESIGN.md, "The token ledger")."""

    max_num_batched_tokens: int = 2048
    """Token budget of one step: positions computed across all requests."""
    max_num_seqs: int = 256
    """Maximum number of running requests."""
    max_model_len: int | None = None
    """Prompt + output length cap; None takes the model's max_position_embeddings."""
    long_prefill_token_threshold: int = 0
    """If > 0, a prompt chunk is at most this many tokens per step (fairness to decodes)."""
    async_scheduling: bool = False
    """Schedule and prepare step N+1 while step N computes (DESIGN "The step loop"): each
    running request holds a placeholder for its in-flight token, which step N+1 reads on
    the device. Outputs are the same as without it; n-gram drafting is off in this mode."""

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _require(
            self.max_model_len is None or self.max_model_len >= 2,
            f"max_model_len must be >= 2 or None, got {self.max_model_len}",
        )
        _require(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold must be >= 0 (0 turns it off)",
        )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int | None = None
    """Number of KV blocks; None derives it from kv_cache_bytes."""
    kv_cache_bytes: int | None = None
    """Bytes of the KV pool when num_blocks is None; None: 256 MiB on CPU, and on CUDA what
    gpu_memory_utilization leaves after the weights and activations."""
    max_kv_keep_alive_s: float = 60.0
    """The longest a finished request's cached KV blocks are held for its conversation's next
    turn when it asks (`SamplingParams.kv_keep_alive_s`); 0 holds none. Holds yield to any
    request that needs the blocks (see rollout_engine/core/kv_holds.py)."""
    gpu_memory_utilization: float = 0.5
    """CUDA: the fraction of the device's memory this engine may use in all (vLLM's name);
    the rest is the trainer's. Used when kv_cache_bytes and num_blocks are None."""
    enable_prefix_caching: bool = True
    """Reuse KV of identical full prompt blocks across requests."""

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, "block_size must be >= 1")
        _require(math.isfinite(self.max_kv_keep_alive_s) and self.max_kv_keep_alive_s >= 0,
                 f"max_kv_keep_alive_s must be a finite number >= 0, got {self.max_kv_keep_alive_s}")
        _require(self.num_blocks is None or self.num_blocks >= 1, "num_blocks must be >= 1")
        _require(self.kv_cache_bytes is None or self.kv_cache_bytes >= 1,
                 "kv_cache_bytes must be >= 1 (or None to size it from the device)")
        _require(0.0 < self.gpu_memory_utilization <= 1.0,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


SpecMethod = Literal["ngram", "suffix"]


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding with drafts from text already seen (vLLM's `speculative_config`
    names): "ngram" (prompt lookup in the request's own tokens) or "suffix" (SuffixDecoding:
    also earlier completions of the same prompt; `core/suffix_proposer.py`)."""

    num_speculative_tokens: int = 0
    """Draft tokens proposed per step; 0 turns speculative decoding off."""
    method: SpecMethod = "ngram"
    prompt_lookup_min: int = 2
    """Shortest suffix n-gram to match."""
    prompt_lookup_max: int = 5
    """Longest suffix n-gram to match."""
    disable_by_batch_size: int = 32
    """Above this many running requests, n-gram drafting stops; suffix drafting goes on for the
    requests whose prompts' drafts are mostly accepted, and for as many others as this leaves
    room for, those expected to run longest first (a budget for the long tail)."""
    suffix_decoding_max_tree_depth: int = 64
    """Longest suffix matched (tokens)."""
    suffix_decoding_max_spec_factor: float = 1.0
    """A draft is at most this many times as long as its match."""
    suffix_decoding_min_token_prob: float = 0.1
    """A draft stops where its path's estimated probability falls below this."""
    suffix_decoding_max_cached_tokens: int = 1 << 22
    """Tokens of earlier completions kept, engine-wide (the oldest completion goes first)."""

    def __post_init__(self) -> None:
        _require(self.method in ("ngram", "suffix"),
                 f"speculative method must be 'ngram' or 'suffix', got {self.method!r}")
        _require(self.num_speculative_tokens >= 0, "num_speculative_tokens must be >= 0")
        _require(self.prompt_lookup_min >= 1, "prompt_lookup_min must be >= 1")
        _require(
            self.prompt_lookup_max >= self.prompt_lookup_min,
            "prompt_lookup_max must be >= prompt_lookup_min",
        )
        _require(self.disable_by_batch_size >= 1, "disable_by_batch_size must be >= 1")
        _require(self.suffix_decoding_max_tree_depth >= 1,
                 "suffix_decoding_max_tree_depth must be >= 1")
        _require(self.suffix_decoding_max_spec_factor > 0,
                 "suffix_decoding_max_spec_factor must be > 0")
        _require(0.0 <= self.suffix_decoding_min_token_prob <= 1.0,
                 "suffix_decoding_min_token_prob must be in [0, 1]")
        _require(self.suffix_decoding_max_cached_tokens >= 0,
                 "suffix_decoding_max_cached_tokens must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served unmerged beside the base model (vLLM's names)."""

    enable_lora: bool = False
    max_loras: int = 1
    """Adapters a step may run at once (device slots); a request whose adapter would make one
    more waits for a slot to free."""
    max_lora_rank: int = 16
    """The largest rank an adapter may have."""
    max_cpu_loras: int | None = None
    """Adapters loaded from a path kept in host memory (None: `max_loras`); beyond that the
    least recently used idle one is dropped and read again from its path when next asked."""

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        _require(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        _require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            f"max_cpu_loras must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}",
        )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class MemoryConfig:
    """Sleep mode and memory accounting (see DESIGN.md, "Memory")."""

    timeline_max_events: int = 10_000
    """The memory timeline keeps only this many newest events (sleep, wake, weight updates)."""

    def __post_init__(self) -> None:
        _require(self.timeline_max_events >= 1, "timeline_max_events must be >= 1")


KVRole = Literal["prefill", "decode", "both"]


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill–decode disaggregation (DESIGN "The step loop"): which side of a KV transfer
    this engine plays, and how the KV moves."""

    kv_role: KVRole | None = None
    """"prefill" saves prompts' KV for a decode engine, "decode" loads it, "both" does
    either; None refuses every KV transfer."""
    kv_transport: str = "shm"
    """How this engine, as the prefill side, hands KV over: "shm" (/dev/shm, one host),
    "grpc" (pulled from this server, any host) or "cuda_ipc" (one GPU)."""
    kv_peer: str | None = None
    """Decode side, transport "grpc": the prefill server to pull from when a handle names
    none (an offline engine's handle)."""
    kv_transfer_timeout_s: float = 30.0
    """Decode side: a transfer not done by then is given up, and the prompt recomputed."""
    kv_handle_ttl_s: float = 120.0
    """Prefill side: saved KV nobody pulled is dropped after this long."""

    def __post_init__(self) -> None:
        _require(
            self.kv_role in (None, "prefill", "decode", "both"),
            f"kv_role must be prefill, decode or both, got {self.kv_role!r}",
        )
        _require(
            self.kv_transport in KV_TRANSPORTS,
            f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}",
        )
        _require(self.kv_transfer_timeout_s > 0, "kv_transfer_timeout_s must be > 0")
        _require(self.kv_handle_ttl_s > 0, "kv_handle_ttl_s must be > 0")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism inside one engine (DESIGN "Scale-out"): one process per rank."""

    tensor_parallel_size: int = 1
    """Ranks the model is split over; 1 runs in this process alone (no process group)."""
    distributed_timeout_s: float = 60.0
    """A collective or command a rank has not completed by then fails the step, naming the
    rank (and so does a rank that dies): nothing waits forever on a lost rank."""

    def __post_init__(self) -> None:
        _require(
            self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}",
        )
        _require(self.distributed_timeout_s > 0, "distributed_timeout_s must be > 0")


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens (gRPC, and HTTP with `http_port`) and admits work."""

    host: str = "127.0.0.1"
    """Address to bind; anything but loopback needs an auth token (or allow_insecure_remote)."""
    port: int = 50051
    """TCP port; 0 picks a free one (the ready line says which)."""
    max_inflight_requests: int = 4096
    """Samples (prompts x n) admitted at once across all calls; more get RESOURCE_EXHAUSTED."""
    max_n: int = 1024
    """Largest `n` (samples per prompt) a call may ask for; more get INVALID_ARGUMENT."""
    auth_token: str | None = None
    """If set, every call but the health check needs `authorization: Bearer <token>`."""
    allow_insecure_remote: bool = False
    """Allow a non-loopback bind without a token (trusted networks only)."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest gRPC message either way, and largest HTTP request body."""
    shutdown_grace_s: float = 10.0
    """On SIGTERM, in-flight calls get this long to finish before they are aborted."""
    engine_stall_s: float = 60.0
    """Health says NOT_SERVING while one engine step or command has run this long."""
    http_port: int | None = None
    """Also serve `vllm serve`'s HTTP API on this port of `host` (0 picks a free one); None:
    gRPC only. Both share one engine, one admission limit and one weight version."""
    api_key: str | None = None
    """If set, every HTTP request but `/health` needs `Authorization: Bearer <key>`."""
    enable_control_endpoints: bool = False
    """Serve the RL control endpoints (`/sleep`, `/wake_up`, `/pause`, ...) on a non-loopback
    HTTP bind too (vLLM's dev mode); on loopback they are always served."""
    served_model_names: tuple[str, ...] = ()
    """The names HTTP requests may give as `model` (the first is reported); () takes the
    model path."""
    trust_request_chat_template: bool = False
    """Render a chat request's own `chat_template` (vLLM's flag; HTTP chat and gRPC
    RenderChat); without it such a request is refused: a template is code that runs in the
    server."""
    enable_tokenizer_info_endpoint: bool = False
    """Serve `GET /tokenizer_info` (vLLM's flag): the tokenizer's configuration, chat template
    included."""
    enable_auto_tool_choice: bool = False
    """Parse the tool calls of chat requests whose `tool_choice` is "auto" (vLLM's flag)."""
    tool_call_parser: str | None = None
    """The format tool calls are read in, and written in for "required" and named choices:
    hermes, qwen3_xml, qwen3_coder, llama3_json, pythonic, mistral (vLLM's names)."""
    reasoning_parser: str | None = None
    """Split the reasoning (`<think> ... </think>`) from the answer: qwen3, deepseek_r1."""
    exclude_tools_when_tool_choice_none: bool = False
    """With `tool_choice` "none", render the prompt without the tools (vLLM's flag)."""
    structured_outputs_in_reasoning: bool = False
    """With a reasoning parser, constrain from the first token rather than once the reasoning
    has ended (vLLM's `--structured-outputs-config '{"enable_in_reasoning": true}'`)."""

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        _require(self.max_inflight_requests >= 1, "max_inflight_requests must be >= 1")
        _require(self.max_n >= 1, "max_n must be >= 1")
        _require(self.max_message_bytes >= 1024 * 1024, "max_message_bytes must be at least 1 MiB")
        _require(self.shutdown_grace_s >= 0, "shutdown_grace_s must be >= 0")
        _require(self.engine_stall_s > 0, "engine_stall_s must be > 0")
        _require(
            is_loopback_host(self.host) or bool(self.auth_token) or self.allow_insecure_remote,
            f"refusing to bind {self.host!r} without --auth-token: anyone who can reach it "
            "could generate, put the engine to sleep or replace its weights; set --auth-token, "
            "or pass --allow-insecure-remote on a trusted network",
        )
        self._check_http()

    def _check_http(self) -> None:
        from rollout_engine.parsing import ChatParsing  # checks the parser names

        ChatParsing(self.reasoning_parser, self.tool_call_parser)
        _require(not self.enable_auto_tool_choice or self.tool_call_parser is not None,
                 "--enable-auto-tool-choice needs --tool-call-parser (the format to read)")
        if self.http_port is None:
            http_only = (self.api_key is not None, self.enable_control_endpoints,
                         self.enable_tokenizer_info_endpoint,
                         self.enable_auto_tool_choice, self.tool_call_parser is not None,
                         self.reasoning_parser is not None,
                         self.exclude_tools_when_tool_choice_none,
                         self.structured_outputs_in_reasoning)
            _require(not any(http_only),
                     "--api-key, --enable-control-endpoints, --enable-tokenizer-info-endpoint "
                     "and the tool and reasoning parser flags apply to the HTTP server: set "
                     "--http-port too")
            return
        _require(0 <= self.http_port <= 65535,
                 f"http_port must be in [0, 65535], got {self.http_port}")
        _require(self.http_port == 0 or self.http_port != self.port,
                 f"http_port and port are both {self.port}: give HTTP a port of its own")
        _require(
            is_loopback_host(self.host) or bool(self.api_key) or self.allow_insecure_remote,
            f"refusing to serve HTTP on {self.host!r} without --api-key: anyone who can reach "
            "it could generate (or, with --enable-control-endpoints, put the engine to "
            "sleep); set --api-key, or pass --allow-insecure-remote on a trusted network",
        )


def is_loopback_host(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1; False for wildcard and other addresses."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs, grouped by concern."""

    model_config: ModelConfig
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    memory_config: MemoryConfig = field(default_factory=MemoryConfig)
    kv_transfer_config: KVTransferConfig = field(default_factory=KVTransferConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.lora_config.enable_lora:
            _require(not self.model_config.batch_invariant,
                     "enable_lora is not supported with batch_invariant yet; turn one of them off")
            _require(not self.model_config.cuda_graphs,
                     "enable_lora is not supported with cuda_graphs yet; turn one of them off")
            _require(self.kv_transfer_config.kv_role is None,
                     "enable_lora is not supported with KV transfers (kv_role) yet; turn one of "
                     "them off")
        if self.parallel_config.tensor_parallel_size == 1:
            return
        _require(
            not self.scheduler_config.async_scheduling,
            "async_scheduling is not supported with tensor_parallel_size > 1; turn one of "
            "them off",
        )
        _require(
            not self.model_config.cuda_graphs,
            "cuda_graphs is not supported with tensor_parallel_size > 1; turn one of them off",
        )
        _require(
            self.kv_transfer_config.kv_role is None,
            "KV transfers (kv_role) are not supported with tensor_parallel_size > 1; turn "
            "one of them off",
        )
        _require(
            not self.lora_config.enable_lora,
            "enable_lora is not supported with tensor_parallel_size > 1 yet; turn one of them off",
        )

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from flat field names, as in `LLM(model, max_num_batched_tokens=...)`."""
        groups: dict[str, dict[str, Any]] = {name: {} for name in _GROUPS}
        speculative = kwargs.pop("speculative_config", None)
        if speculative is not None:  # vLLM's dict; the flat `num_speculative_tokens=` too
            if isinstance(speculative, SpeculativeConfig):
                speculative = dataclasses.asdict(speculative)
            if not isinstance(speculative, dict):  # unknown keys: TypeError when it is built
                raise TypeError("speculative_config must be a dict or a SpeculativeConfig, got "
                                f"{type(speculative).__name__}")
            groups["speculative_config"].update(speculative)
        for key, value in kwargs.items():
            owner = _FIELD_OWNER.get(key)
            if owner is None:
                raise TypeError(
                    f"unknown engine option {key!r}; valid options: {sorted(_FIELD_OWNER)}"
                )
            groups[owner][key] = value
        return cls(
            model_config=ModelConfig(model=model, **groups["model_config"]),
            scheduler_config=SchedulerConfig(**groups["scheduler_config"]),
            cache_config=CacheConfig(**groups["cache_config"]),
            speculative_config=SpeculativeConfig(**groups["speculative_config"]),
            memory_config=MemoryConfig(**groups["memory_config"]),
            kv_transfer_config=KVTransferConfig(**groups["kv_transfer_config"]),
            parallel_config=ParallelConfig(**groups["parallel_config"]),
            lora_config=LoRAConfig(**groups["lora_config"]),
        )


@dataclass(frozen=True)
class RuntimeLimits:
    """Values known only once the model and KV pool exist."""

    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()


_GROUPS: dict[str, type] = {
    "model_config": ModelConfig,
    "scheduler_config": SchedulerConfig,
    "cache_config": CacheConfig,
    "speculative_config": SpeculativeConfig,
    "memory_config": MemoryConfig,
    "kv_transfer_config": KVTransferConfig,
    "parallel_config": ParallelConfig,
    "lora_config": LoRAConfig,
}
_FIELD_OWNER: dict[str, str] = {
    f.name: group
    for group, klass in _GROUPS.items()
    for f in dataclasses.fields(klass)
    if f.name != "model"
}
