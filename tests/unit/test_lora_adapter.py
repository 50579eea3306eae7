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


NUM_EXPERTS, HIDDEN, INTERMEDIATE = 3, 8, 4
EXPERTS = {"model.layers.0.mlp.experts.gate_up_proj": (NUM_EXPERTS, HIDDEN, 2 * INTERMEDIATE),
           "model.layers.0.mlp.experts.down_proj": (NUM_EXPERTS, INTERMEDIATE, HIDDEN)}


def expert_tensors(order: tuple[str, str] = ("down_proj", "gate_up_proj"), r: int = 2,
                   adapter: str = ""):
    """PEFT's nested ParamWrapper names, the first of `order` the inner one (`base_layer`; PEFT
    itself puts gate|up there)."""
    infix = f".{adapter}" if adapter else ""
    out = {}
    for depth, parameter in enumerate(order):
        _, in_features, out_features = EXPERTS[f"model.layers.0.mlp.experts.{parameter}"]
        module = "base_model.model.model.layers.0.mlp.experts" + ".base_layer" * (1 - depth)
        out[f"{module}.lora_A{infix}.weight"] = torch.randn(NUM_EXPERTS * r, in_features)
        out[f"{module}.lora_B{infix}.weight"] = torch.randn(out_features, r * NUM_EXPERTS)
    return out


@pytest.mark.parametrize("order", [("down_proj", "gate_up_proj"), ("gate_up_proj", "down_proj")])
@pytest.mark.parametrize("adapter", ["", "default"])
def test_experts_parameters_are_told_by_shape(order, adapter):
    """Either nesting, saved or live names: each pair goes to the parameter its shapes fit,
    expert e's A the rows [e r, (e + 1) r) and B the columns e, e + E, ... (PEFT's layout)."""
    raw = expert_tensors(order, adapter=adapter)
    config = {"r": 2, "lora_alpha": 4, "alpha_pattern": {"experts.down_proj": 6}}
    weights = build_lora_weights(config, raw, LINEARS, 16, torch.float32, experts=EXPERTS)
    assert set(weights.deltas) == set(EXPERTS)
    for depth, parameter in enumerate(order):
        delta = weights.deltas[f"model.layers.0.mlp.experts.{parameter}"]
        module = "base_model.model.model.layers.0.mlp.experts" + ".base_layer" * (1 - depth)
        infix = f".{adapter}" if adapter else ""
        a, b = raw[f"{module}.lora_A{infix}.weight"], raw[f"{module}.lora_B{infix}.weight"]
        assert delta.rank == 2 and delta.scaling == (3.0 if parameter == "down_proj" else 2.0)
        for e in range(NUM_EXPERTS):
            torch.testing.assert_close(delta.a[e], a[2 * e : 2 * e + 2])
            torch.testing.assert_close(delta.b[e], b[:, e::NUM_EXPERTS])


@pytest.mark.parametrize("change, message", [
    (lambda t: {k: (v[:, :-1] if "base_layer.lora_A" in k else v) for k, v in t.items()},
     "fit none"),
    (lambda t: {k: v for k, v in t.items() if "base_layer.lora_B" not in k}, "no lora_B"),
    (lambda t: {k.replace("mlp.experts", "mlp.gate"): v for k, v in t.items()},
     "this model runs LoRA on"),
])
def test_experts_refusals(change, message):
    with pytest.raises(LoRAError, match=message):
        build_lora_weights({}, change(expert_tensors()), LINEARS, 16, torch.float32,
                           experts=EXPERTS)
    with pytest.raises(LoRAError, match="max_lora_rank"):
        build_lora_weights({}, expert_tensors(r=4), LINEARS, 2, torch.float32, experts=EXPERTS)
