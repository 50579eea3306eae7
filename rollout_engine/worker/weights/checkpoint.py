"""Loads a Hugging Face model directory (config + safetensors) into our decoder or, for other
architectures, into the transformers backend (`transformers_backend.py`)."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn

from rollout_engine.protocol import ModelLoadError
from rollout_engine.worker.models.decoder import DecoderForCausalLM
from rollout_engine.worker.models.native_config import unimplemented_fields
from rollout_engine.worker.tp.tp_group import TPGroup

# Allocates a parameter's storage: (shape, dtype) -> tensor. The memory manager passes
# one that carves views out of its weights pool.
Allocator = Callable[[torch.Size, torch.dtype], torch.Tensor]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Checkpoint entries that are not parameters of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The native decoder has no lm_head module when the embeddings are tied: a checkpoint (or an
# update) naming it means the embedding.
_NATIVE_TIED_ALIASES = {"lm_head.weight": "model.embed_tokens.weight"}

ResolvedModelImpl = Literal["native", "transformers"]


def load_hf_config(model_dir: str, model_impl: str = "auto"):
    """The checkpoint's transformers config; ModelLoadError if missing, or if `model_impl`
    (see `ModelConfig.model_impl`) cannot run it."""
    if not os.path.isdir(model_dir):
        raise ModelLoadError(f"model directory {model_dir!r} does not exist")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ModelLoadError(f"{model_dir!r} has no config.json; is it a Hugging Face model dir?")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot read the config in {model_dir!r}: {exc}") from exc
    if resolve_model_impl(config, model_impl) == "transformers":
        _check_transformers_config(config, model_impl)
    return config


def resolve_model_impl(hf_config, model_impl: str) -> ResolvedModelImpl:
    """The modeling code that runs this config: "auto" takes the native decoder when it
    implements the architecture and every config field that changes the model
    (`native_config.NATIVE_CONFIG_FIELDS`), the transformers backend otherwise; ModelLoadError
    naming what it lacks for "native"."""
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


def _check_transformers_config(config, model_impl: str) -> None:
    """The transformers backend's refusal, with what the native decoder lacks when "auto"
    fell back to the backend for it."""
    from rollout_engine.worker.models.transformers_backend import check_config

    try:
        check_config(config)
    except ModelLoadError as exc:
        unimplemented = unimplemented_fields(config) if model_impl == "auto" else []
        if unimplemented:
            raise ModelLoadError(
                f"{exc}; and the native decoder cannot run it either: {'; '.join(unimplemented)}"
            ) from exc
        raise


def resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    """"auto" takes the checkpoint's dtype on GPU and float32 on CPU."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = _DTYPES.get(checkpoint_dtype, torch.float32)
    return checkpoint_dtype or torch.bfloat16


def build_model(
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    allocate: Allocator | None = None,
    tp: TPGroup | None = None,
) -> DecoderForCausalLM:
    """An uninitialised model (this rank's shard of it) whose parameters live where
    `allocate` puts them."""
    with torch.device("meta"):
        model = DecoderForCausalLM(hf_config, max_positions, tp)
    if allocate is None:
        allocate = lambda shape, dt: torch.empty(shape, dtype=dt, device=device)
    materialize_parameters(model, dtype, allocate)
    rotary = model.model.rotary_emb
    rotary.cos_sin = torch.empty(rotary.cos_sin.shape, dtype=torch.float32, device=device)
    rotary.rebuild()
    return model.eval()


def parameter_nbytes(
    hf_config, dtype: torch.dtype, alignment: int = 256, tp: TPGroup | None = None
) -> int:
    """Bytes the model's parameters (this rank's shard) need, each rounded up to `alignment`."""
    with torch.device("meta"):
        model = DecoderForCausalLM(hf_config, max_positions=1, tp=tp)
    return pool_nbytes(model, dtype, alignment)


def pool_nbytes(model: nn.Module, dtype: torch.dtype, alignment: int = 256) -> int:
    """Bytes `model`'s parameters (a tied one once) take in a pool as `dtype`, each rounded
    up to `alignment`."""
    size = torch.tensor([], dtype=dtype).element_size()
    return sum(-(-p.numel() * size // alignment) * alignment for p in model.parameters())


def materialize_parameters(model: nn.Module, dtype: torch.dtype, allocate: Allocator) -> None:
    """Give every parameter of a meta-device model uninitialised storage from `allocate`. A
    parameter held by several modules (tied embeddings) gets one storage, still shared."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                storage = allocate(param.shape, dtype)
                replaced[id(param)] = nn.Parameter(storage, requires_grad=False)
            module._parameters[name] = replaced[id(param)]


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Alias -> parameter name for tied weights: the other names of a parameter that several
    modules hold (`named_parameters()` gives it once, under the first), plus the native
    decoder's `lm_head.weight` when it has no lm_head of its own."""
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(param), name)
        if first != name:
            aliases[name] = first
    names = set(canonical.values()) | set(aliases)
    for alias, name in _NATIVE_TIED_ALIASES.items():
        if alias not in names and name in names:
            aliases[alias] = name
    return aliases


def iterate_checkpoint(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of every safetensors file in the directory."""
    for name, lazy in iterate_checkpoint_slices(model_dir):
        yield name, lazy[:]


def iterate_checkpoint_slices(model_dir: str) -> Iterator[tuple[str, Any]]:
    """(name, lazy safetensors slice) pairs: only the part a rank indexes is read."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {model_dir!r}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                yield name, f.get_slice(name)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, Any]]) -> None:
    """Copy checkpoint tensors (or lazy slices) into the parameters of the same name, each
    rank taking its shard; all must be present with their full checkpoint shapes. A tied
    weight's other names (`tied_aliases`) are skipped: their tensor is the same."""
    params = dict(model.named_parameters())
    specs = model.shard_specs()
    aliases = tied_aliases(model)
    missing = set(params)
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or name in aliases:
            continue
        param = params.get(name)
        if param is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} matches no parameter of the model")
        shape = tuple(tensor.shape) if hasattr(tensor, "shape") else tuple(tensor.get_shape())
        if specs[name].full_shape != shape:
            raise ModelLoadError(
                f"checkpoint tensor {name!r} has shape {shape}, "
                f"the model expects {specs[name].full_shape}"
            )
        with torch.no_grad():
            specs[name].copy_into(param, tensor)
        missing.discard(name)
    if missing:
        raise ModelLoadError(f"checkpoint lacks parameters: {sorted(missing)[:8]}")
