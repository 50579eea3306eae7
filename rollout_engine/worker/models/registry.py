"""The model registry: which modeling code runs a checkpoint, decided once, and the backend
that answers for it (what it refuses, how it loads, its KV cache spec, its packed linears).

`model_impl="auto"` takes the native decoder when it implements the architecture and every
config field that changes the model (`native_config.NATIVE_CONFIG_FIELDS`), the transformers
backend otherwise. Nothing outside this module names an implementation: the worker, the model
runner, the tensor-parallel ranks and the CUDA graphs receive a `ModelBackend` and its model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, Literal

import torch

from memory import MemoryPool
from rollout_engine.config import EngineConfig
from rollout_engine.protocol import ModelLoadError
from rollout_engine.worker.kv_cache_spec import KVCacheSpec
from rollout_engine.worker.models.decoder import DecoderForCausalLM
from rollout_engine.worker.models.fused_norms import fuse_rms_norms
from rollout_engine.worker.models.native_config import unimplemented_fields
from rollout_engine.worker.models.packed_linear import (
    PackedCopies,
    PackedModuleLinears,
    PackedWeights,
)
from rollout_engine.worker.models.tp_sharding import check_tensor_parallel
from rollout_engine.worker.models.transformers_backend import TransformersForCausalLM, check_config
from rollout_engine.worker.tp.tp_group import TPGroup
from rollout_engine.worker.weights.checkpoint import (
    iterate_checkpoint_slices,
    load_weights,
    materialize_parameters,
    pool_nbytes,
)

ResolvedModelImpl = Literal["native", "transformers"]
CausalLM = DecoderForCausalLM | TransformersForCausalLM
"""A model the registry builds: `forward(input_ids, positions, kv_caches, metadata)` on a flat
ragged batch, `compute_logits(hidden)`, `shard_specs()`, parameters named as the checkpoint's."""
PoolFactory = Callable[[int], MemoryPool]
"""Creates the "weights" pool of a size in bytes (`EngineMemory.create_weights_pool`)."""


def check_hf_config(hf_config, model_impl: str) -> None:
    """ModelLoadError unless `model_impl` (see `ModelConfig.model_impl`) runs this config,
    saying why; from the config alone (the transformers backend probes the model at load)."""
    _BACKENDS[resolve_model_impl(hf_config, model_impl)].check_config(hf_config, model_impl)


def resolve_model_impl(hf_config, model_impl: str) -> ResolvedModelImpl:
    """The modeling code that runs this config (see the module docstring); ModelLoadError
    naming what the native decoder lacks when "native" is asked for and cannot run it."""
    if model_impl == "transformers":
        return "transformers"
    unimplemented = unimplemented_fields(hf_config)
    if not unimplemented:
        return "native"
    if model_impl == "auto":
        return "transformers"
    raise ModelLoadError(
        f"the native decoder cannot run this checkpoint: {'; '.join(unimplemented)}; use "
        "model_impl='transformers' or 'auto'"
    )


def resolve_model_backend(config: EngineConfig, hf_config) -> ModelBackend:
    """The backend that runs this engine's model: ModelLoadError if none runs the config,
    ValueError for what of the engine's configuration that backend cannot do."""
    backend = _BACKENDS[resolve_model_impl(hf_config, config.model_config.model_impl)](hf_config)
    backend.check_engine(config)
    return backend


class ModelBackend(ABC):
    """One implementation of one checkpoint's model: the checks it makes, its loading, and
    what the worker asks of the model it loaded."""

    name: ClassVar[ResolvedModelImpl]

    def __init__(self, hf_config) -> None:
        self.hf_config = hf_config

    @classmethod
    def check_config(cls, hf_config, model_impl: str) -> None:
        """ModelLoadError for a config this implementation cannot run, from the config alone
        (the native decoder's refusal is `resolve_model_impl`'s, which names the field)."""

    @abstractmethod
    def check_engine(self, config: EngineConfig) -> None:
        """ValueError for what of the engine's configuration (tensor parallelism, CUDA graphs)
        this implementation cannot do."""

    @abstractmethod
    def load(
        self, model_dir: str, dtype: torch.dtype, device: torch.device, max_model_len: int,
        create_pool: PoolFactory, tp: TPGroup,
    ) -> tuple[CausalLM, int]:
        """The model (this rank's shard) holding the checkpoint's weights in a pool made by
        `create_pool`, and the pool's size in bytes."""

    @abstractmethod
    def kv_cache_spec(self, model: CausalLM, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """The paged KV cache the loaded model reads and writes, per layer."""

    @abstractmethod
    def packed_linears(self, model: CausalLM) -> PackedCopies:
        """CPU: the model's linears as oneDNN packs them (see `packed_linear.py`)."""

    def invariant_packed_linears(self, model: CausalLM) -> PackedCopies | None:
        """CPU, batch invariance: the model's linears packed for the batch-invariant GEMM, or
        None where they go through the mode's routing of `F.linear` (the same bits)."""
        return None


class NativeBackend(ModelBackend):
    """Our decoder (Llama, Qwen2, Qwen3): split over tensor-parallel ranks, captured in CUDA
    graphs, its q|k|v and gate|up linears packed fused on the CPU."""

    name = "native"

    def check_engine(self, config: EngineConfig) -> None:
        check_tensor_parallel(self.hf_config, config.parallel_config.tensor_parallel_size)

    def load(
        self, model_dir: str, dtype: torch.dtype, device: torch.device, max_model_len: int,
        create_pool: PoolFactory, tp: TPGroup,
    ) -> tuple[DecoderForCausalLM, int]:
        with torch.device("meta"):
            model = DecoderForCausalLM(self.hf_config, max_model_len, tp)
        pool = create_pool(pool_nbytes(model, dtype))
        materialize_parameters(model, dtype, pool.allocate)
        # RoPE's table is a buffer, no weight: outside the pool, rebuilt from the config.
        rotary = model.model.rotary_emb
        rotary.cos_sin = torch.empty(rotary.cos_sin.shape, dtype=torch.float32, device=device)
        rotary.rebuild()
        load_weights(model, iterate_checkpoint_slices(model_dir))
        return model.eval(), pool.num_bytes

    def kv_cache_spec(
        self, model: DecoderForCausalLM, block_size: int, dtype: torch.dtype
    ) -> KVCacheSpec:
        """From the config: every layer alike but for its window, this rank's KV heads."""
        return KVCacheSpec.from_model(self.hf_config, block_size, dtype, model.tp.size)

    def packed_linears(self, model: DecoderForCausalLM) -> PackedWeights:
        return PackedWeights(model)

    def invariant_packed_linears(self, model: DecoderForCausalLM) -> PackedWeights:
        return PackedWeights(model, invariant=True)


class TransformersBackend(ModelBackend):
    """Hugging Face's modeling code over our paged KV cache (`transformers_backend.py`), for
    the decoders the native one does not implement: replicated and eager, its `nn.Linear`s
    packed one by one on the CPU."""

    name = "transformers"

    @classmethod
    def check_config(cls, hf_config, model_impl: str) -> None:
        """The backend's refusal, with what the native decoder lacks when "auto" fell back to
        the backend for it."""
        try:
            check_config(hf_config)
        except ModelLoadError as exc:
            unimplemented = unimplemented_fields(hf_config) if model_impl == "auto" else []
            if unimplemented:
                raise ModelLoadError(
                    f"{exc}; and the native decoder cannot run it either: "
                    f"{'; '.join(unimplemented)}"
                ) from exc
            raise

    def check_engine(self, config: EngineConfig) -> None:
        hf_config = self.hf_config
        architecture = (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]
        tp_size = config.parallel_config.tensor_parallel_size
        if tp_size > 1:
            raise ValueError(
                f"tensor_parallel_size {tp_size}: the transformers backend (model_impl="
                f"'transformers', which runs {architecture}) does not split models yet; use "
                "tensor_parallel_size=1"
            )
        if config.model_config.cuda_graphs:
            raise ValueError(
                f"cuda_graphs: the transformers backend (which runs {architecture}) runs "
                "eagerly; turn cuda_graphs off"
            )

    def load(
        self, model_dir: str, dtype: torch.dtype, device: torch.device, max_model_len: int,
        create_pool: PoolFactory, tp: TPGroup,
    ) -> tuple[TransformersForCausalLM, int]:
        """Built on the meta device, given the pool's storage, loaded, then probed once
        (`check_runs`): a model it cannot run exactly is refused here, with the reason. Then its
        RMSNorm modules that the fused CPU op computes exactly run on it (`fused_norms.py`)."""
        model = TransformersForCausalLM(self.hf_config, dtype)
        pool = create_pool(pool_nbytes(model, dtype))
        model.materialize(pool.allocate, device)
        model.load_checkpoint(model_dir)
        model.check_runs()
        fuse_rms_norms(model)
        return model, pool.num_bytes

    def kv_cache_spec(
        self, model: TransformersForCausalLM, block_size: int, dtype: torch.dtype
    ) -> KVCacheSpec:
        """From the per-layer KV the load probe saw (head dims, windows, shared layers)."""
        return KVCacheSpec(block_size, dtype, tuple(model.layer_kv_specs))

    def packed_linears(self, model: TransformersForCausalLM) -> PackedModuleLinears:
        return PackedModuleLinears(model)


_BACKENDS: dict[str, type[ModelBackend]] = {
    backend.name: backend for backend in (NativeBackend, TransformersBackend)
}
