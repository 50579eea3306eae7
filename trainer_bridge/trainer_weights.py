"""The trainer's policy weights under Hugging Face names, one tensor at a time.

`iter_policy_weights(model, accelerator)` is what a weight sync reads. It yields views of
live parameters, valid only until the iteration moves on, so a reader copies each tensor
before asking for the next (the transports do: see `trainer_bridge.transports`).

- **PEFT (LoRA) models**: the adapters are merged into the base weights for the duration of
  the iteration, which yields the merged base weights (adapter tensors are skipped, PEFT's
  name prefixes are removed), and unmerged when it ends or is closed early.
- **Plain models, one process or DDP**: every rank holds the full parameters; no collective.
- **Sharded models (DeepSpeed ZeRO-3, FSDP)**: gathering is collective, so every rank must
  iterate. This one case uses TRL's own gatherer (private: `VLLMGeneration._iter_named_params`,
  pinned to the TRL minor version in pyproject; `tests/e2e/test_trl_backend.py` checks it is
  there) rather than a second copy of that logic.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."


def is_peft_model(model: torch.nn.Module) -> bool:
    return all(hasattr(model, a) for a in ("peft_config", "merge_adapter", "unmerge_adapter"))


def is_sharded(accelerator: Any | None) -> bool:
    """DeepSpeed ZeRO-3 or FSDP: parameters must be gathered (collectively) to be read."""
    if accelerator is None:
        return False
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and getattr(plugin, "zero_stage", 0) == 3:
        return True
    return getattr(accelerator.state, "fsdp_plugin", None) is not None


def iter_policy_weights(
    model: torch.nn.Module, accelerator: Any | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every policy weight; see the module docstring."""
    if accelerator is not None:
        model = accelerator.unwrap_model(model)
    if is_sharded(accelerator):
        yield from _gathered_by_trl(model, accelerator)
    elif is_peft_model(model):
        yield from _merged_peft_weights(model)
    else:
        for name, param in model.named_parameters():
            yield name.replace(CHECKPOINT_WRAPPER, ""), param.data


def _merged_peft_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Merged base weights of a PEFT model; merged only while the iteration runs."""
    model.merge_adapter()
    try:
        yield from peft_base_weights(model)
    finally:
        model.unmerge_adapter()


def peft_base_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of a PEFT model's base weights as they are now (merged or
    not): adapter tensors skipped, PEFT's name prefixes removed."""
    prefix = getattr(getattr(model, "base_model", model), "prefix", "lora_")
    for name, param in model.named_parameters():
        if prefix in name or "original_module" in name:
            continue  # adapter weights, and the copy modules_to_save keeps of the original
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        name = name.replace("modules_to_save.default.", "").replace(CHECKPOINT_WRAPPER, "")
        yield name, param.data


def _gathered_by_trl(model: torch.nn.Module, accelerator: Any) -> Iterator[tuple[str, torch.Tensor]]:
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    gatherer = VLLMGeneration.__new__(VLLMGeneration)  # only its gathering state, no engine
    gatherer.model, gatherer.accelerator = model, accelerator
    gatherer._dist = DistributedBackend(accelerator)
    yield from gatherer._iter_named_params()
