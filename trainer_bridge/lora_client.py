"""EngineClient's LoRA verbs: load an adapter from the server's disk or push one from memory
over the weight transports, unload, list (vLLM's `load_lora_adapter` and friends)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from protos import rollout_pb2 as pb
from rollout_engine.protocol import EngineError, LoadedLoRA, LoRAError
from trainer_bridge import transports
from trainer_bridge.client_messages import lora_from_proto, peft_config_json


class LoRAClient:
    """Mixed into EngineClient (its stub, retries and weight pushes)."""

    def load_lora_adapter(
        self,
        lora_name: str,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None,
        peft_config: Mapping[str, Any] | Any | None = None,
        *,
        lora_path: str = "",
        load_inplace: bool = False,
        transport: str = "auto",
        timeout: float | None = None,
        dtype: torch.dtype | None = None,
    ) -> LoadedLoRA:
        """Load a LoRA adapter (vLLM's `load_lora_adapter`): from a PEFT directory on the
        server's disk (`lora_path`), or from memory: `weights` (the adapter's tensors under
        PEFT's names, as `get_peft_model_state_dict` gives them) and `peft_config` (a
        LoraConfig or its dict), pushed over the weight transports as `update_weights` pushes
        weights; no disk. Checked whole by the server: if anything is refused, nothing
        changes. `load_inplace` replaces the adapter of this name (requests running under the
        old one finish under it). Requests then name it (`lora_name=`)."""
        if weights is None:
            reply = self._retrying(self._stub.LoadLoRAAdapter, pb.LoadLoRAAdapterRequest(
                lora_name=lora_name, lora_path=lora_path, load_inplace=load_inplace), timeout)
            return lora_from_proto(reply.adapter)
        if peft_config is None:
            raise LoRAError("pass the adapter's peft_config with its weights")
        weights = transports.named_tensors(weights)
        target = pb.LoRATarget(lora_name=lora_name, peft_config_json=peft_config_json(peft_config),
                               load_inplace=load_inplace)
        manifest = dataclasses.replace(transports.WeightManifest.of(weights), lora=target)
        reply = self._push(weights, manifest, transport, transports.DEFAULT_BUCKET_BYTES,
                           timeout, dtype)
        if reply.WhichOneof("kind") != "lora_adapter":
            raise EngineError("the server ended the LoRA push without loading the adapter")
        return lora_from_proto(reply.lora_adapter)

    def unload_lora_adapter(self, lora_name: str, timeout: float | None = None) -> bool:
        """False if no adapter has this name; requests running under it finish under it."""
        reply = self._retrying(self._stub.UnloadLoRAAdapter,
                               pb.UnloadLoRAAdapterRequest(lora_name=lora_name), timeout)
        return reply.removed

    def list_lora_adapters(self, timeout: float | None = None) -> list[LoadedLoRA]:
        reply = self._retrying(self._stub.ListLoRAAdapters, pb.ListLoRAAdaptersRequest(), timeout)
        return [lora_from_proto(adapter) for adapter in reply.adapters]

