"""The Triton LoRA kernels (`kernels/triton_lora.py`) under TRITON_INTERPRET=1 on CPU tensors:
against the delta written in torch (the CPU kernel's reference), with tokens of the base model
between adapters' tokens, slots that target some linears only, ranks below the slots' maximum
and strided outputs; and a LoRA point on the Triton path gives its torch path's outputs."""

from __future__ import annotations

import pytest
import torch

from rollout_engine.worker.lora import slots as lora_slots
from rollout_engine.worker.lora.adapter import LoRAWeights, ModuleDelta
from rollout_engine.worker.lora.slots import LoRASlots
from tests.unit.test_kernels_triton import pytestmark, triton_kernels  # noqa: F401
from tests.unit.test_lora_kernel import reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features, out_features, max_rank",
                         [(64, [64, 32, 32], 8), (72, [40, 300], 16)])
def test_kernel_matches_the_torch_delta(triton_kernels, dtype, in_features,  # noqa: F811
                                        out_features, max_rank):
    torch.manual_seed(0)
    num_tokens, num_slots = 13, 3
    linears = len(out_features)
    x = torch.randn(num_tokens, in_features).to(dtype)
    a = torch.randn(num_slots, linears * max_rank, in_features).to(dtype)
    bt = [torch.randn(num_slots, max_rank, out).to(dtype) for out in out_features]
    packed = torch.randn(num_tokens, sum(out_features)).to(dtype)
    outs = list(packed.split(out_features, -1))  # strided views, written in place
    blocks = torch.tensor([[0, 1, 2], [-1, 0, -1], [1, -1, 0]])[:, :linears]
    blocks[2, :] = torch.arange(linears - 1, -1, -1)  # every linear, in another order
    ranks = torch.tensor([max_rank, 5, 3])
    groups = [(0, [0, 1, 2, 9]), (2, [3, 12, 5]), (1, [4, 6, 7, 11])]
    row_slots = torch.full((num_tokens,), -1, dtype=torch.int32)
    for slot, rows in groups:
        row_slots[rows] = slot
    untouched = (row_slots < 0).nonzero().flatten()  # the base model's tokens
    expected = reference(x, a, bt, outs, groups, blocks, ranks)
    before = packed.clone()
    triton_kernels.lora.lora_add_triton(x, a, bt, outs, row_slots, blocks.to(torch.int32),
                                        ranks.to(torch.int32))
    # float32 sums of ~100 products of unit normals, in another order than torch's
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (3e-2, 3e-2)
    for got, want in zip(outs, expected):
        torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=atol, rtol=rtol)
    assert torch.equal(packed[untouched], before[untouched])


def test_point_triton_and_torch_paths_agree(triton_kernels, monkeypatch):  # noqa: F811
    torch.manual_seed(1)
    slots = LoRASlots(max_loras=2, device=torch.device("cpu"))
    point = slots.add_point(["gate", "up"], 32, [48, 48], max_rank=8, dtype=torch.float32)
    for adapter_id, (rank, targets) in enumerate([(8, ["up"]), (3, ["gate", "up"])], 1):
        deltas = {name: ModuleDelta(torch.randn(rank, 32), torch.randn(48, rank), 0.5)
                  for name in targets}
        slots.register(adapter_id, LoRAWeights(deltas))
    x = torch.randn(10, 32)
    results = []
    for backend in ("triton", "torch"):
        monkeypatch.setattr(lora_slots, "lora_backend", lambda device, backend=backend: backend)
        packed = torch.zeros(10, 96)
        slots.begin_step([(1, 0, 3), (2, 3, 5), (1, 7, 10)], num_rows=10)
        assert (slots.step.row_slots is not None) == (backend == "triton")
        point.add(x, packed.split([48, 48], -1))
        slots.end_step()
        results.append(packed)
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)
    assert results[0][5:7].eq(0).all() and results[0][:3, 48:].ne(0).any()
    assert results[0][:3, :48].eq(0).all()  # adapter 1 targets "up" only


def test_engine_on_the_triton_path_gives_pefts_tokens(triton_kernels, llama_dir, tmp_path,  # noqa: F811
                                                      monkeypatch):
    """The engine's LoRA wiring on the Triton path (row slots built per step, the points'
    tables on the device), interpreted: a batch mixing an adapter and the base model."""
    from rollout_engine import LLM, LoRARequest, SamplingParams
    from tests.integration.hf_oracle import load_hf_model
    from tests.lora_adapters import load_peft, make_adapter, peft_greedy

    monkeypatch.setattr(lora_slots, "lora_backend", lambda device: "triton")
    path = make_adapter(llama_dir, tmp_path / "all", r=4, target_modules="all-linear", seed=3)
    lora = LoRARequest("all", 1, str(path))
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=1, max_lora_rank=4)
    prompts, max_tokens = [[5, 17, 99, 250, 7], [3, 14, 15, 92]], 4
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=[lora, None])
    oracles = [load_peft(llama_dir, path), load_hf_model(str(llama_dir))]
    for prompt, oracle, output in zip(prompts, oracles, outputs):
        assert list(output.outputs[0].token_ids) == peft_greedy(oracle, prompt, max_tokens)
