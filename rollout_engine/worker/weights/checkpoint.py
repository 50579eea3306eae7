"""A checkpoint's tensors into a model's parameters: storage from a pool, the safetensors files
read lazily, each rank's shard copied in, tied weights once. Knows no implementation: the
model registry (`models/registry.py`) builds the model these fill."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from rollout_engine.protocol import ModelLoadError

# Allocates a parameter's storage: (shape, dtype) -> tensor. The memory manager passes
# one that carves views out of its weights pool.
Allocator = Callable[[torch.Size, torch.dtype], torch.Tensor]

# Checkpoint entries that are not parameters of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The native decoder has no lm_head module when the embeddings are tied: a checkpoint (or an
# update) naming it means the embedding.
_NATIVE_TIED_ALIASES = {"lm_head.weight": "model.embed_tokens.weight"}


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
