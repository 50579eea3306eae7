"""The compiled LoRA kernel (`kernels/csrc/lora_cpu.cpp`) against the delta written in torch:
every dtype, widths with and without vector tails, ranks below the slots' maximum, groups whose
rows are not contiguous, slots that target some linears only; indexes out of range refused
before anything is written. And the LoRA point's torch path agrees with its compiled one."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension
from rollout_engine.worker.lora.adapter import LoRAWeights, ModuleDelta
from rollout_engine.worker.lora.slots import LoRASlots
from tests.unit.test_fused_ops_cpu import kernel  # noqa: F401 - the build fixture

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(x, a, bt, outs, groups, blocks, ranks):
    """The deltas in float32, per token: out_i += (a_block @ x) @ bt_i[:rank]."""
    expected = [o.float().clone() for o in outs]
    for slot, rows in groups:
        rank = int(ranks[slot])
        for i, block in enumerate(blocks[slot].tolist()):
            if block < 0 or rank == 0:
                continue
            shrunk = x[rows].float() @ a[slot, block * rank : (block + 1) * rank].float().T
            expected[i][rows] += shrunk @ bt[i][slot, :rank].float()
    return expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features, out_features", [(64, [64, 32, 32]), (40, [72, 24, 8])])
def test_kernel_matches_the_torch_delta(dtype, in_features, out_features):
    torch.manual_seed(0)
    num_tokens, max_rank, num_slots = 19, 8, 3
    x = torch.randn(num_tokens, in_features).to(dtype)
    a = torch.randn(num_slots, 3 * max_rank, in_features).to(dtype)
    bt = [torch.randn(num_slots, max_rank, out).to(dtype) for out in out_features]
    packed = torch.randn(num_tokens, sum(out_features)).to(dtype)
    outs = list(packed.split(out_features, -1))  # strided views, written in place
    blocks = torch.tensor([[0, 1, 2], [-1, 0, -1], [1, -1, 0]])
    ranks = torch.tensor([8, 5, 3])
    groups = [(0, [0, 1, 2, 9, 10]), (2, [3, 17, 5]), (1, [18, 4, 6, 7, 8, 11, 12])]
    expected = reference(x, a, bt, outs, groups, blocks, ranks)
    untouched = [r for r in range(num_tokens) if all(r not in rows for _, rows in groups)]
    before = packed.clone()
    rows = torch.tensor([r for _, group_rows in groups for r in group_rows])
    offsets = torch.tensor([0, 5, 8, 15])
    slots = torch.tensor([slot for slot, _ in groups])
    cpu_extension.lora_add(x, a, bt, outs, rows, offsets, slots, blocks, ranks)
    # float32 sums of ~100 products of unit normals, in another order than torch's (which
    # order depends on the CPU's vector width)
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (3e-2, 3e-2)
    for got, want in zip(outs, expected):
        torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=atol, rtol=rtol)
    assert torch.equal(packed[untouched], before[untouched])


@pytest.mark.parametrize("bad", ["row", "slot", "offsets", "block"])
def test_out_of_range_indexes_are_refused_before_writing(bad):
    x, a = torch.randn(4, 16), torch.randn(2, 8, 16)
    bt, out = [torch.randn(2, 4, 16)], torch.zeros(4, 16)
    rows, offsets, slots = torch.tensor([0, 1, 2]), torch.tensor([0, 3]), torch.tensor([1])
    blocks, ranks = torch.tensor([[0], [1]]), torch.tensor([4, 4])
    if bad == "row":
        rows = torch.tensor([0, 1, 4])
    elif bad == "slot":
        slots = torch.tensor([2])
    elif bad == "offsets":
        offsets = torch.tensor([0, 4])
    else:
        blocks = torch.tensor([[0], [2]])
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_extension.lora_add(x, a, bt, [out], rows, offsets, slots, blocks, ranks)
    assert not out.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_point_compiled_and_torch_paths_agree(dtype, monkeypatch):
    torch.manual_seed(1)
    slots = LoRASlots(max_loras=2, device=torch.device("cpu"))
    point = slots.add_point(["q", "k", "v"], 32, [32, 16, 16], max_rank=8, dtype=dtype)
    out_features = {"q": 32, "k": 16, "v": 16}
    for adapter_id, (rank, targets) in enumerate([(8, ["q", "v"]), (3, ["k", "q", "v"])], 1):
        deltas = {name: ModuleDelta(torch.randn(rank, 32).to(dtype),
                                    torch.randn(out_features[name], rank).to(dtype), 0.5)
                  for name in targets}
        slots.register(adapter_id, LoRAWeights(deltas))
    x = torch.randn(10, 32).to(dtype)
    results = []
    for compiled in (True, False):
        monkeypatch.setattr(cpu_extension, "available", lambda compiled=compiled: compiled)
        packed = torch.zeros(10, 64, dtype=dtype)
        slots.begin_step([(1, 0, 3), (2, 3, 5), (1, 7, 10)], num_rows=10)
        point.add(x, packed.split([32, 16, 16], -1))
        slots.end_step()
        results.append(packed)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(results[0].float(), results[1].float(), atol=tolerance,
                               rtol=tolerance)
    assert results[0][5:7].eq(0).all() and results[0][:5].ne(0).any()
