"""LoRA adapters a request can run under (vLLM's `LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_engine.protocol.exceptions import LoRAError


@dataclass(frozen=True)
class LoRARequest:
    """One LoRA adapter, as vLLM names it: `lora_name` (what HTTP's `model=` says),
    `lora_int_id` (> 0, unique per adapter on an engine) and `lora_path` (a PEFT adapter
    directory: `adapter_config.json` and `adapter_model.safetensors` or `.bin`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise LoRAError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")


@dataclass(frozen=True)
class LoadedLoRA:
    """An adapter as a server holds it: its name, id and path, and `version`, the load its
    weights came from. Every load gets a new number, engine-wide (a first load, an in-place
    replacement, a re-read from its path after host memory dropped it); 0 while it is not held
    in memory. A completion's `weight_versions` name the load that sampled it
    (`WeightVersionSpan.lora_version`), so a trainer can tell an old adapter from its
    in-place replacement."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    version: int
