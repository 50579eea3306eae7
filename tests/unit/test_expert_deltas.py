"""LoRA deltas on MoE experts (`ExpertsLoRAPoint`): a step mixing adapters (of other ranks,
one leaving gate|up alone) and the base model gives, for every token, the experts' output
with its adapter merged into the expert weights (transformers' experts as the oracle), through
the grouped CPU kernels (packed weights, the BGMV kernel) and through torch's grouped GEMMs."""

from __future__ import annotations

import copy

import pytest
import torch

from kernels import cpu_extension
from rollout_engine.worker.lora.adapter import LoRAWeights, ModuleDelta
from rollout_engine.worker.lora.expert_deltas import ExpertsLoRAPoint
from rollout_engine.worker.lora.slots import LoRAGroup, LoRAStep
from rollout_engine.worker.models.experts import pack_experts

NUM_EXPERTS, HIDDEN, WIDTH, TOP_K, SLOTS, MAX_RANK = 4, 32, 24, 2, 3, 8


def make_experts() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=WIDTH,
                            num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K)
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    return experts


def adapter(rank: int, parameters: tuple[str, ...], seed: int) -> LoRAWeights:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"gate_up_proj": (HIDDEN, 2 * WIDTH), "down_proj": (WIDTH, HIDDEN)}
    deltas = {}
    for parameter in parameters:
        in_features, out_features = shapes[parameter]
        deltas[f"experts.{parameter}"] = ModuleDelta(
            torch.randn(NUM_EXPERTS, rank, in_features, generator=generator) * 0.3,
            torch.randn(NUM_EXPERTS, out_features, rank, generator=generator) * 0.3, 0.5 * seed)
    return LoRAWeights(deltas)


def merged(experts: torch.nn.Module, weights: LoRAWeights) -> torch.nn.Module:
    """The module with every expert's delta added to its weights (what PEFT computes)."""
    merged = copy.deepcopy(experts)
    with torch.no_grad():
        for name, delta in weights.deltas.items():
            getattr(merged, name.split(".")[1]).add_(delta.scaling * delta.b @ delta.a)
    return merged


@pytest.mark.parametrize("path", ["cpu kernels", "torch"])
def test_each_token_gets_its_adapters_merged_experts(path, monkeypatch):
    from transformers.integrations.moe import grouped_mm_experts_forward

    if path == "cpu kernels" and not cpu_extension.available():
        pytest.skip("the compiled CPU kernels are not built")
    if path == "torch":
        monkeypatch.setattr(cpu_extension, "available", lambda: False)
    torch.manual_seed(0)
    experts = make_experts()
    adapters = [adapter(8, ("gate_up_proj", "down_proj"), 1), adapter(2, ("down_proj",), 2),
                adapter(5, ("gate_up_proj", "down_proj"), 3)]
    step = LoRAStep()
    point = ExpertsLoRAPoint("experts", NUM_EXPERTS, HIDDEN, WIDTH, SLOTS, MAX_RANK,
                             torch.float32, torch.device("cpu"), step)
    for slot, weights in enumerate(adapters):
        point.load(slot, weights)
    num_tokens = 23
    rows = {0: torch.tensor([0, 5, 6, 17]), 1: slice(7, 12), 2: torch.tensor([1, 2, 20, 22])}
    step.num_rows = num_tokens
    step.groups = [LoRAGroup(slot, r) for slot, r in rows.items()]
    x = torch.randn(num_tokens, HIDDEN)
    index = torch.stack([torch.randperm(NUM_EXPERTS)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, TOP_K)
    packed = pack_experts(experts) if path == "cpu kernels" else None
    with torch.inference_mode():
        assert point.runs()
        got = point.forward(experts, x, index, weights, packed)
        expected = grouped_mm_experts_forward(experts, x, index, weights)  # base rows
        for slot, r in rows.items():
            module = merged(experts, adapters[slot])
            expected[r] = grouped_mm_experts_forward(module, x[r], index[r], weights[r])
        base_only = grouped_mm_experts_forward(experts, x, index, weights)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for r in rows.values():  # control: the deltas matter
        assert (got[r] - base_only[r]).abs().max() > 1e-2
    for slot in range(len(adapters)):
        point.clear(slot)
    assert not point.runs()  # cleared slots: the plain experts' path runs
