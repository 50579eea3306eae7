"""LoRA deltas applied unmerged: adapters in device slots, a step's tokens grouped by slot.

A `LoRAPoint` is where the model adds deltas: the output of one linear, or of linears that
share their input and run as one packed GEMM (the native decoder's q|k|v and gate|up). Each
point holds `max_loras` slots of stacked weights: the A matrices of its linears side by side
([slots, linears * max_rank, in]), so that a group of tokens shrinks its input with one GEMM,
and each linear's B transposed ([slots, max_rank, out]), with the adapter's scaling folded in.

A step's tokens come grouped by the adapter their request runs under (`LoRAGroup`: a slot
and its rows). Per point, the backend (`lora_backend`) adds every group's deltas: on the CPU
one compiled call (`kernels/csrc/lora_cpu.cpp`, Punica's BGMV); on CUDA two Triton launches
and one per linear (`kernels/triton_lora.py`, BGMV too: every token reads its slot by index);
elsewhere, per group, one shrink GEMM and one expand GEMM per linear the adapter targets,
added into the base output in place (the grouped GEMMs of SGMV, written with torch's). Tokens
of the base model are in no group: their rows cost nothing.

`LoRASlots` owns the points, the adapters registered on the worker (host copies) and which
adapter sits in which slot: a step's adapters are put into slots before its forward (the
scheduler never runs more than `max_loras` at once), reusing the least recently used slot.
The experts of a mixture-of-experts layer take their deltas at an `ExpertsLoRAPoint`
(`expert_deltas.py`), which shares the slots and the step's groups.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kernels import cpu_extension
from rollout_engine.protocol import LoRAError
from rollout_engine.worker.lora.adapter import LoRAWeights
from rollout_engine.worker.lora.expert_deltas import ExpertsLoRAPoint


def lora_backend(device: torch.device) -> Literal["cpu", "triton", "torch"]:
    """Who adds the deltas on `device`: the compiled CPU kernel, Triton, or torch's GEMMs."""
    if device.type == "cpu":
        return "cpu" if cpu_extension.available() else "torch"
    return "triton" if device.type == "cuda" else "torch"


@dataclass
class LoRAGroup:
    """The rows of a step's flat token batch that run under the adapter in `slot`."""

    slot: int
    rows: slice | torch.Tensor
    """A slice when contiguous, else an int64 index tensor on the device."""

    def take(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.rows] if isinstance(self.rows, slice) else x.index_select(0, self.rows)

    def add_into(self, out: torch.Tensor, delta: torch.Tensor) -> None:
        if isinstance(self.rows, slice):
            out[self.rows] += delta
        else:
            out.index_add_(0, self.rows, delta)


class LoRAStep:
    """The groups of the step being run, shared by every point (empty: no adapter runs)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No step running: no groups."""
        self.groups: list[LoRAGroup] = []
        self.num_rows = 0
        """Tokens in the step: the rows every point's input has."""
        self.rows = self.group_offsets = self.group_slots = None
        """The groups as the CPU kernel takes them (int64, on the CPU): every group's rows in
        turn, where each group's start, and its slot."""
        self.row_slots: torch.Tensor | None = None
        """The groups as the Triton kernel takes them: each row's slot (int32 on the device;
        -1: the base model)."""
        self._slot_of_rows: torch.Tensor | None = None

    def slot_of_rows(self, device: torch.device) -> torch.Tensor:
        """Each row's slot (int64 on `device`; -1: the base model), built once per step."""
        if self._slot_of_rows is None:
            slots = torch.full((self.num_rows,), -1, dtype=torch.int64, device=device)
            for group in self.groups:
                slots[group.rows] = group.slot
            self._slot_of_rows = slots
        return self._slot_of_rows


class LoRAPoint:
    """The deltas of linears sharing one input (see the module doc)."""

    def __init__(
        self, names: Sequence[str], in_features: int, out_features: Sequence[int],
        max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device, step: LoRAStep,
    ) -> None:
        self.names = list(names)
        self.in_features = in_features
        self.out_features = list(out_features)
        self.step = step
        self.a = torch.zeros(max_loras, len(names) * max_rank, in_features, dtype=dtype,
                             device=device)
        self.bt = [torch.zeros(max_loras, max_rank, out, dtype=dtype, device=device)
                   for out in out_features]
        """Per linear, B transposed ([rank, out] per slot), the scaling folded in."""
        self.linear_blocks = torch.full((max_loras, len(names)), -1, dtype=torch.int64)
        """Per slot and linear: the block of A's rows it uses (-1: the adapter targets none)."""
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)
        """Per slot: the rank each block is padded to."""
        self._device_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        """`linear_blocks` and `ranks` as int32 on the device (Triton), until they change."""

    def load(self, slot: int, weights: LoRAWeights) -> None:
        """Put this point's part of an adapter into `slot` (zeros where it targets nothing)."""
        self.a[slot].zero_()
        for bt in self.bt:
            bt[slot].zero_()
        deltas = [(i, weights.deltas[n]) for i, n in enumerate(self.names) if n in weights.deltas]
        rank = max((d.rank for _, d in deltas), default=0)
        self.linear_blocks[slot] = -1
        for j, (i, delta) in enumerate(deltas):
            self.a[slot, j * rank : j * rank + delta.rank] = delta.a
            scaled = (delta.b.float() * delta.scaling).to(self.bt[i].dtype)
            self.bt[i][slot, : delta.rank] = scaled.T
            self.linear_blocks[slot, i] = j
        self.ranks[slot] = rank
        self._device_tables = None

    def clear(self, slot: int) -> None:
        self.linear_blocks[slot], self.ranks[slot] = -1, 0
        self._device_tables = None

    def add(self, x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """Add the step's deltas into the linears' outputs. x: [T, in]; outs: one [T, out_i]
        per linear (views into one packed output are fine: written in place)."""
        if x.shape[0] != self.step.num_rows:
            raise LoRAError(
                f"{self.names[0]} ran on {x.shape[0]} rows, not the step's {self.step.num_rows} "
                "tokens (a module run on a subset of tokens, such as one expert of a MoE, "
                "cannot take a LoRA adapter here)"
            )
        if not self.step.groups:
            return
        step = self.step
        unit_strides = x.stride(-1) == 1 and all(o.stride(-1) == 1 for o in outs)
        if step.rows is not None and self._runs_compiled(x, outs):
            cpu_extension.lora_add(x, self.a, self.bt, list(outs), step.rows, step.group_offsets,
                                   step.group_slots, self.linear_blocks, self.ranks)
            return
        if step.row_slots is not None and unit_strides:
            from kernels.triton_lora import lora_add_triton

            if self._device_tables is None:
                self._device_tables = (self.linear_blocks.to(x.device, torch.int32),
                                       self.ranks.to(x.device, torch.int32))
            lora_add_triton(x, self.a, self.bt, list(outs), step.row_slots,
                            *self._device_tables)
            return
        for group in self.step.groups:
            rank = int(self.ranks[group.slot])
            blocks = self.linear_blocks[group.slot].tolist()
            linears = [i for i, block in enumerate(blocks) if block >= 0]
            if not linears:
                continue
            a = self.a[group.slot, : len(linears) * rank]
            shrunk = group.take(x) @ a.T  # [rows, linears * rank]
            for i in linears:
                block = blocks[i]
                delta = shrunk[:, block * rank : (block + 1) * rank] @ self.bt[i][group.slot, :rank]
                group.add_into(outs[i], delta)

    def _runs_compiled(self, x: torch.Tensor, outs: Sequence[torch.Tensor]) -> bool:
        return (x.device.type == "cpu" and x.dtype == self.a.dtype and x.stride(-1) == 1
                and all(o.dtype == x.dtype and o.stride(-1) == 1 for o in outs))

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.a, *self.bt]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def move_into(self, allocate: Callable[[Sequence[int], torch.dtype], torch.Tensor]) -> None:
        self.a = allocate(self.a.shape, self.a.dtype)
        self.bt = [allocate(bt.shape, bt.dtype) for bt in self.bt]


class LoRASlots:
    """The worker's adapters: registered ones in host memory, `max_loras` of them in the
    points' device slots; `begin_step` puts a step's adapters into slots and groups its rows."""

    def __init__(self, max_loras: int, device: torch.device) -> None:
        self.max_loras = max_loras
        self.device = device
        self.step = LoRAStep()
        self.points: list[LoRAPoint | ExpertsLoRAPoint] = []
        self.adapters: dict[int, LoRAWeights] = {}
        """Registered adapters by engine-wide id, host copies."""
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        """Adapter id -> its slot, least recently run first."""
        self.num_slot_loads = 0

    def add_point(self, names: Sequence[str], in_features: int, out_features: Sequence[int],
                  max_rank: int, dtype: torch.dtype) -> LoRAPoint:
        point = LoRAPoint(names, in_features, out_features, self.max_loras, max_rank, dtype,
                          self.device, self.step)
        self.points.append(point)
        return point

    def add_experts_point(self, prefix: str, num_experts: int, hidden_size: int,
                          intermediate_size: int, max_rank: int,
                          dtype: torch.dtype) -> ExpertsLoRAPoint:
        point = ExpertsLoRAPoint(prefix, num_experts, hidden_size, intermediate_size,
                                 self.max_loras, max_rank, dtype, self.device, self.step)
        self.points.append(point)
        return point

    @property
    def linears(self) -> dict[str, tuple[int, int]]:
        """Every linear a delta can target: name -> (in features, out features)."""
        return {name: (p.in_features, out) for p in self.points if isinstance(p, LoRAPoint)
                for name, out in zip(p.names, p.out_features)}

    @property
    def experts(self) -> dict[str, tuple[int, int, int]]:
        """Every experts parameter a delta can target: `<module>.<parameter>` -> (experts,
        in features, out features)."""
        return {name: shape for p in self.points if isinstance(p, ExpertsLoRAPoint)
                for name, shape in p.targets.items()}

    def register(self, adapter_id: int, weights: LoRAWeights) -> None:
        self.adapters[adapter_id] = weights

    def unregister(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)
        slot = self._slot_of.pop(adapter_id, None)
        if slot is not None:
            for point in self.points:
                point.clear(slot)

    def begin_step(self, runs: Sequence[tuple[int, int, int]], num_rows: int) -> None:
        """runs: (adapter id, first row, end row) of the step's tokens under an adapter, in
        row order. Puts the adapters into slots and sets the groups every point reads."""
        rows_of: dict[int, list[tuple[int, int]]] = {}
        for adapter_id, start, end in runs:
            rows_of.setdefault(adapter_id, []).append((start, end))
        if len(rows_of) > self.max_loras:
            raise LoRAError(f"a step runs {len(rows_of)} adapters, more than max_loras "
                            f"{self.max_loras}")
        groups = []
        for adapter_id, spans in rows_of.items():
            slot = self._slot(adapter_id, keep=rows_of.keys())
            groups.append(LoRAGroup(slot, self._rows(spans)))
        self.step.reset()
        self.step.groups, self.step.num_rows = groups, num_rows
        backend = lora_backend(self.device)
        if backend == "cpu":
            self._kernel_groups(rows_of)
        elif backend == "triton" and groups:
            self._row_slots(rows_of, num_rows)

    def _kernel_groups(self, rows_of: dict[int, list[tuple[int, int]]]) -> None:
        rows, offsets = [], [0]
        for spans in rows_of.values():
            for start, end in spans:
                rows.extend(range(start, end))
            offsets.append(len(rows))
        step = self.step
        step.rows = torch.tensor(rows, dtype=torch.int64)
        step.group_offsets = torch.tensor(offsets, dtype=torch.int64)
        step.group_slots = torch.tensor([g.slot for g in step.groups], dtype=torch.int64)

    def _row_slots(self, rows_of: dict[int, list[tuple[int, int]]], num_rows: int) -> None:
        row_slots = torch.full((num_rows,), -1, dtype=torch.int32)
        for group, spans in zip(self.step.groups, rows_of.values()):
            for start, end in spans:
                row_slots[start:end] = group.slot
        self.step.row_slots = row_slots.to(self.device, non_blocking=True)

    def end_step(self) -> None:
        self.step.reset()

    def _slot(self, adapter_id: int, keep) -> int:
        """The adapter's slot, loading it into a free or the least recently run one."""
        if adapter_id in self._slot_of:
            self._slot_of.move_to_end(adapter_id)
            return self._slot_of[adapter_id]
        weights = self.adapters.get(adapter_id)
        if weights is None:
            raise LoRAError(f"LoRA adapter {adapter_id} is not loaded on the worker")
        used = set(self._slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(a for a in self._slot_of if a not in keep)
            slot = self._slot_of.pop(victim)
        for point in self.points:
            point.load(slot, weights)
        self._slot_of[adapter_id] = slot
        self.num_slot_loads += 1
        return slot

    def _rows(self, spans: list[tuple[int, int]]) -> slice | torch.Tensor:
        merged = [list(spans[0])]
        for start, end in spans[1:]:
            if start == merged[-1][1]:
                merged[-1][1] = end
            else:
                merged.append([start, end])
        if len(merged) == 1:
            return slice(*merged[0])
        index = torch.cat([torch.arange(s, e) for s, e in merged])
        return index.to(self.device, non_blocking=True)

    @property
    def num_bytes(self) -> int:
        """Device memory of the slots."""
        return sum(point.num_bytes for point in self.points)

    def move_into(self, allocate: Callable[[Sequence[int], torch.dtype], torch.Tensor]) -> None:
        """Give every point's weights their place in a pool (`allocate(shape, dtype)`), empty."""
        for point in self.points:
            point.move_into(allocate)
        self.forget_slots()

    def forget_slots(self) -> None:
        """Every slot empty (its memory was released or zeroed): adapters are put back into
        slots by the steps that run them."""
        self._slot_of.clear()
        for point in self.points:
            for slot in range(self.max_loras):
                point.clear(slot)
