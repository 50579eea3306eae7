"""A Hugging Face model directory as the engine reads it: its config, checked by the model
registry against the implementation that will run it, its dtype, and its tensors whole."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import torch

from rollout_engine.protocol import ModelLoadError
from rollout_engine.worker.cpu_features import cpu_computes_bf16
from rollout_engine.worker.models.registry import check_hf_config
from rollout_engine.worker.weights.checkpoint import iterate_checkpoint_slices

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
    check_hf_config(config, model_impl)
    return config


def resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    """"auto": on a GPU the checkpoint's dtype; on the CPU bfloat16 for a bfloat16 checkpoint
    where the CPU computes in bfloat16 (vLLM's CPU default), float32 otherwise: without bfloat16
    arithmetic a bfloat16 GEMM is emulated, far slower than float32 (`benchmarks/roofline.py`:
    0.3 against 180 GFLOP/s on AVX2, 66 against 338 on AVX-512 without BF16). An explicit
    "bfloat16" on such a CPU runs its packed linears on float32 copies of the weights
    (`packed_linear.gemm_dtype`): float32's speed, bfloat16's results."""
    if dtype != "auto":
        return _DTYPES[dtype]
    checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = _DTYPES.get(checkpoint_dtype, torch.float32)
    if device.type != "cpu":
        return checkpoint_dtype or torch.bfloat16
    if checkpoint_dtype == torch.bfloat16 and cpu_computes_bf16():
        return torch.bfloat16
    if checkpoint_dtype == torch.bfloat16:
        logger.info("a bfloat16 checkpoint runs in float32: this CPU has no bfloat16 arithmetic "
                    "(AVX-512 BF16)")
    return torch.float32


def iterate_checkpoint(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of every safetensors file in the directory (e.g. to send them as
    a weight update)."""
    for name, lazy in iterate_checkpoint_slices(model_dir):
        yield name, lazy[:]
