"""LoRA deltas on the experts of a mixture-of-experts layer, unmerged, grouped by (expert, slot).

PEFT adapts experts through `target_parameters` (`adapter.py` reads them): every expert `e` of
a 3-d parameter gets its own low-rank delta, so a (token, expert) pair under the adapter in
slot `s` computes `W_e x + B_se (A_se x)` for gate|up and again for down, with the activation
between them. The delta therefore cannot be added to the layer's output afterwards (as
`slots.LoRAPoint` does for a linear): an `ExpertsLoRAPoint` runs the whole experts forward
when a step's adapters touch its module, and stays out of the way otherwise (base-only steps,
or adapters that leave the experts alone, keep the grouped CPU kernel or the Triton fused MoE).

The forward sorts the step's (token, expert) pairs by expert, then by slot, base pairs first.
The base projections run over the expert groups: on the CPU through the grouped experts
kernel's GEMM on the packed weights (`cpu_extension.moe_grouped_linear`), elsewhere (and when
the weights are not packed) as transformers' grouped GEMMs. The pairs under an adapter, taken
out in the same order, are already grouped by `expert * max_loras + slot`: each delta is the
BGMV of `slots.py` with every (expert, slot) as one of its slots (`cpu_extension.lora_add`, one
call per parameter), or two grouped GEMMs over those groups (shrink to the rank, expand). The
weights sit as [experts, slots, ...] so that the groups' weights are one view, each padded to
`max_lora_rank` (a slot whose adapter leaves a parameter alone holds no rank there).

Measured on two AVX-512 cores (`benchmarks/lora.py --moe`): see benchmarks/README.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from kernels import cpu_extension
from rollout_engine.protocol import LoRAError
from rollout_engine.worker.lora.adapter import LoRAWeights

PARAMETERS = ("gate_up_proj", "down_proj")
"""The experts parameters an adapter can target, in the order the forward runs them."""


class ExpertsLoRAPoint:
    """The per-expert deltas of one experts module (gate|up [E, 2I, H] and down [E, H, I])."""

    def __init__(self, prefix: str, num_experts: int, hidden_size: int, intermediate_size: int,
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 step) -> None:
        self.names = [f"{prefix}.{parameter}" for parameter in PARAMETERS]
        self.shapes = [(num_experts, hidden_size, 2 * intermediate_size),
                       (num_experts, intermediate_size, hidden_size)]
        """Per parameter: (experts, in features, out features)."""
        self.max_loras = max_loras
        self.step = step
        self.a = [torch.zeros(num_experts, max_loras, max_rank, in_features, dtype=dtype,
                              device=device) for _, in_features, _ in self.shapes]
        self.bt = [torch.zeros(num_experts, max_loras, max_rank, out_features, dtype=dtype,
                               device=device) for _, _, out_features in self.shapes]
        """Per parameter, B of every (expert, slot) transposed, the scaling folded in."""
        self.ranks = [[0] * max_loras for _ in PARAMETERS]
        """Per parameter and slot: its adapter's rank there (0: the adapter leaves it alone)."""
        self._kernel_tables: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [*self.a, *self.bt]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def targets(self) -> dict[str, tuple[int, int, int]]:
        return dict(zip(self.names, self.shapes))

    def load(self, slot: int, weights: LoRAWeights) -> None:
        for i, (name, a, bt) in enumerate(zip(self.names, self.a, self.bt)):
            a[:, slot].zero_()
            bt[:, slot].zero_()
            delta = weights.deltas.get(name)
            rank = 0 if delta is None else delta.rank
            if delta is not None:
                a[:, slot, :rank] = delta.a
                bt[:, slot, :rank] = (delta.b.float() * delta.scaling).transpose(1, 2)
            self.ranks[i][slot] = rank
        self._kernel_tables = None

    def clear(self, slot: int) -> None:
        for ranks in self.ranks:
            ranks[slot] = 0
        self._kernel_tables = None

    def move_into(self, allocate: Callable[[Sequence[int], torch.dtype], torch.Tensor]) -> None:
        self.a = [allocate(a.shape, a.dtype) for a in self.a]
        self.bt = [allocate(bt.shape, bt.dtype) for bt in self.bt]

    def runs(self) -> bool:
        """Whether the step being run has an adapter that targets these experts."""
        return any(ranks[group.slot] for group in self.step.groups for ranks in self.ranks)

    def forward(self, module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, packed=None) -> torch.Tensor:
        """The experts module's forward with every pair's delta: hidden_states [T, H],
        top_k_index / top_k_weights [T, k] -> [T, H] (transformers' experts signature);
        `packed`: the module's `PackedExperts`, when the grouped CPU kernel may run them."""
        num_tokens, top_k = top_k_index.shape
        if num_tokens != self.step.num_rows:
            raise LoRAError(f"{self.names[0]} ran on {num_tokens} rows, not the step's "
                            f"{self.step.num_rows} tokens")
        num_experts, slots = self.shapes[0][0], self.max_loras
        pair_slots = self.step.slot_of_rows(hidden_states.device).repeat_interleave(top_k)
        keys = top_k_index.reshape(-1).long() * (slots + 1) + pair_slots + 1
        keys, order = torch.sort(keys, stable=True)
        experts, pair_slots = keys // (slots + 1), keys % (slots + 1) - 1
        x = hidden_states.index_select(0, order // top_k)
        expert_ends = _ends(experts, num_experts)
        lora_pairs = torch.nonzero(pair_slots >= 0).squeeze(1)
        groups = experts.index_select(0, lora_pairs) * slots + pair_slots.index_select(0, lora_pairs)
        # Laid out once for both parameters: the experts' bounds for the packed GEMMs, the
        # (expert, slot) groups for the BGMV kernel or for torch's grouped GEMMs.
        expert_offsets = (None if packed is None
                          else torch.cat([expert_ends.new_zeros(1), expert_ends]).long())
        compiled = (hidden_states.device.type == "cpu" and cpu_extension.available()
                    and hidden_states.dtype == self.a[0].dtype)
        kernel_groups = _kernel_groups(groups) if compiled else None
        group_ends = None if compiled else _ends(groups, num_experts * slots)

        gate_up = _project(x, module.gate_up_proj, expert_ends, expert_offsets,
                           None if packed is None else packed.gate_up)
        self._add_deltas(0, x, gate_up, lora_pairs, kernel_groups, group_ends)
        h = module._apply_gate(gate_up)
        out = _project(h, module.down_proj, expert_ends, expert_offsets,
                       None if packed is None else packed.down)
        self._add_deltas(1, h, out, lora_pairs, kernel_groups, group_ends)

        out = out * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)

    def _add_deltas(self, parameter: int, x: torch.Tensor, out: torch.Tensor,
                    lora_pairs: torch.Tensor,
                    kernel_groups: tuple[torch.Tensor, torch.Tensor] | None,
                    group_ends: torch.Tensor | None) -> None:
        """out[pairs] += Bt^T (A x[pairs]), each pair with its (expert, slot) group's weights:
        through the BGMV kernel (`kernel_groups`, from `_kernel_groups`), or through torch's
        grouped GEMMs (`group_ends`, where each group ends)."""
        a, bt = self.a[parameter].flatten(0, 1), self.bt[parameter].flatten(0, 1)
        if kernel_groups is not None:
            ids, offsets = kernel_groups
            blocks, ranks = self._tables()[parameter]
            cpu_extension.lora_add(x.contiguous(), a, [bt], [out], lora_pairs, offsets, ids,
                                   blocks, ranks)
            return
        from transformers.integrations.moe import _grouped_linear

        shrunk = _grouped_linear(x.index_select(0, lora_pairs), a, group_ends)
        out.index_add_(0, lora_pairs,
                       _grouped_linear(shrunk, bt, group_ends, is_transposed=True))

    def _tables(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per parameter, the BGMV kernel's `linear_blocks` [E * slots, 1] (0, or -1 where the
        slot's adapter leaves the parameter alone) and `ranks` [E * slots]."""
        if self._kernel_tables is None:
            num_experts = self.shapes[0][0]
            self._kernel_tables = []
            for ranks in self.ranks:  # group e * slots + s -> the slot's rank
                ranks = torch.tensor(ranks * num_experts, dtype=torch.int64)
                blocks = torch.where(ranks > 0, 0, -1).unsqueeze(1).contiguous()
                self._kernel_tables.append((blocks, ranks.contiguous()))
        return self._kernel_tables


def _project(x: torch.Tensor, weight: torch.Tensor, expert_ends: torch.Tensor,
             expert_offsets: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
    """x [pairs, in] sorted by expert times each pair's expert's weight [E, out, in]: on its
    packed copy (`moe_pack`) when there is one, else through transformers' grouped GEMMs."""
    if packed is not None:
        return cpu_extension.moe_grouped_linear(x, expert_offsets, packed, weight.shape[1])
    from transformers.integrations.moe import _grouped_linear

    return _grouped_linear(x, weight, expert_ends)


def _kernel_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The non-empty groups of a sorted group id tensor and where each starts (and the last
    ends) among the pairs, int64: the BGMV kernel's `group_slots` and `group_offsets`."""
    ids, counts = torch.unique_consecutive(groups, return_counts=True)
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return ids, offsets


def _ends(sorted_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Where each group of a sorted id tensor ends (int32, grouped GEMMs' offsets)."""
    counts = torch.bincount(sorted_ids, minlength=num_groups)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)
