"""LoRA policies synced unmerged: the engine serves the frozen base weights with the trained
adapter beside them (started with `enable_lora`), and each step sends only the adapter.

`PolicyAdapter(model)` reads a PEFT model as the engine needs it: `adapter()` gives the
adapter's tensors under PEFT's saved names (what `get_peft_model_state_dict` returns: no
merge, so a quantized base (QLoRA) is never touched) and its LoraConfig; `base_weights()` the
base weights under the checkpoint's names, unmerged, for the rare push of the base (the
first sync, or after a sleep that discarded it). `Colocation.sync_adapter` drives the push.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from trainer_bridge.trainer_weights import (
    CHECKPOINT_WRAPPER,
    is_peft_model,
    peft_base_weights,
)

DEFAULT_LORA_NAME = "policy"


class PolicyAdapter:
    """A PEFT model's trained adapter and frozen base, as the engine serves them."""

    def __init__(self, model: torch.nn.Module, lora_name: str = DEFAULT_LORA_NAME,
                 adapter_name: str = "default", push_base: bool = True) -> None:
        if not is_peft_model(model):
            raise ValueError("adapter sync needs a PEFT model (peft.get_peft_model)")
        self.model, self.lora_name, self.adapter_name = model, lora_name, adapter_name
        self.push_base = push_base
        """False: never push the base (a quantized one cannot be): the engine keeps the one it
        loaded, so the trainer must sleep it at level 1 at most (weights kept)."""

    @property
    def peft_config(self) -> Any:
        return self.model.peft_config[self.adapter_name]

    def adapter(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors (views of the live parameters), PEFT's saved names."""
        from peft import get_peft_model_state_dict

        tensors = get_peft_model_state_dict(self.model, adapter_name=self.adapter_name)
        return {name.replace(CHECKPOINT_WRAPPER, ""): t.detach() for name, t in tensors.items()}

    def base_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) of every base weight, the adapter left out, unmerged."""
        return peft_base_weights(self.model)

    def num_adapter_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.adapter().values())
