"""Reading PEFT adapters: the names of a saved adapter and of a live model's state dict,
per-module scaling, and what is refused before anything is registered."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_engine.protocol import LoRAError
from rollout_engine.worker.lora.adapter import build_lora_weights

LINEARS = {"model.layers.0.self_attn.q_proj": (8, 8), "model.layers.0.mlp.down_proj": (16, 8)}


def tensors(prefix: str = "base_model.model.", adapter: str = "", r: int = 2):
    infix = f".{adapter}" if adapter else ""
    out = {}
    for module, (in_features, out_features) in LINEARS.items():
        out[f"{prefix}{module}.lora_A{infix}.weight"] = torch.randn(r, in_features)
        out[f"{prefix}{module}.lora_B{infix}.weight"] = torch.randn(out_features, r)
    return out


@pytest.mark.parametrize("adapter", ["", "default", "policy"])
def test_saved_and_live_names(adapter):
    weights = build_lora_weights({"r": 2, "lora_alpha": 4}, tensors(adapter=adapter), LINEARS,
                                 16, torch.bfloat16)
    assert set(weights.deltas) == set(LINEARS)
    assert all(d.scaling == 2.0 and d.a.dtype == torch.bfloat16 for d in weights.deltas.values())
    assert weights.rank == 2


def test_per_module_scaling():
    config = {"r": 2, "lora_alpha": 4, "use_rslora": True, "alpha_pattern": {"down_proj": 8}}
    weights = build_lora_weights(config, tensors(), LINEARS, 16, torch.float32)
    assert weights.deltas["model.layers.0.self_attn.q_proj"].scaling == 4 / math.sqrt(2)
    assert weights.deltas["model.layers.0.mlp.down_proj"].scaling == 8 / math.sqrt(2)


@pytest.mark.parametrize("config, tensor_set, message", [
    ({"use_dora": True}, tensors(), "DoRA"),
    ({"peft_type": "IA3"}, tensors(), "only LORA"),
    ({}, {**tensors(), "base_model.model.lm_head.lora_A.weight": torch.zeros(2, 8),
          "base_model.model.lm_head.lora_B.weight": torch.zeros(8, 2)}, "not a linear layer"),
    ({}, {**tensors(), "base_model.model.x.lora_magnitude_vector": torch.zeros(2)}, "DoRA"),
    ({}, tensors(r=32), "max_lora_rank"),
    ({}, {}, "no LoRA weights"),
])
def test_refused(config, tensor_set, message):
    with pytest.raises(LoRAError, match=message):
        build_lora_weights(config, tensor_set, LINEARS, 16, torch.float32)
