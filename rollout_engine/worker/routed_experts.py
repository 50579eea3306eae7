"""Which experts each token of a MoE model was routed to, kept beside its KV (routing replay,
R3: the trainer forces the same experts, so its logprobs are the engine's).

Every router module of the Hugging Face model (a `*TopKRouter`, whose forward returns its top-k
expert indices last) is hooked; after each forward the step's indices, [tokens, MoE layers,
top_k], are written into a host tensor with one row per KV slot, at the step's slot mapping,
exactly where the tokens' keys and values went. A position's routing therefore lives as long as
its KV: a prefix-cache hit reads the routing of the request that computed the block, and a
preempted request's recomputed positions are written again. `read(block_ids, start, end)`
gathers a request's rows through its block table; `read_new` appends the rows a request has not
read yet to its `RoutedRows` (streams read each step's few new rows, others all at once).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from rollout_engine.protocol import ModelLoadError


def routers_of(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (modules whose class is a `*TopKRouter`)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


class RoutedRows:
    """One request's routing read so far: positions [0, num_rows), [num_rows, MoE layers, top_k]
    int16. Appends grow it by doubling, so reading a stream row by row costs O(rows) in all."""

    def __init__(self) -> None:
        self._buffer = np.empty((0, 0, 0), dtype=np.int16)  # [capacity, layers, top_k]
        self.num_rows = 0

    def append(self, rows: np.ndarray) -> None:
        end = self.num_rows + len(rows)
        if self.num_rows == 0 and len(self._buffer) < end:
            self._buffer = rows  # the first read, taken as it is (a fresh array)
        else:
            if end > len(self._buffer):
                grown = np.empty((max(end, 2 * len(self._buffer)), *rows.shape[1:]), np.int16)
                grown[: self.num_rows] = self._buffer[: self.num_rows]
                self._buffer = grown
            self._buffer[self.num_rows:end] = rows
        self.num_rows = end

    def view(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Rows [start, end) (end: all read), without copying."""
        return self._buffer[start: self.num_rows if end is None else end]


class RoutingStore:
    """The routing of every KV slot of one engine (see the module doc)."""

    def __init__(self, model: nn.Module, num_slots: int, block_size: int) -> None:
        self.routers = routers_of(model)
        if not self.routers:
            raise ModelLoadError(
                "enable_return_routed_experts needs a mixture-of-experts model whose routers "
                f"are transformers' *TopKRouter modules; {type(model).__name__} has none")
        top_k = int(getattr(self.routers[0], "top_k", 0))
        if top_k <= 0:
            raise ModelLoadError("the MoE router has no top_k: cannot record its experts")
        self.block_size = block_size
        self.store = torch.full((num_slots, len(self.routers), top_k), -1, dtype=torch.int16)
        """Per KV slot: the experts of the token whose KV is there (-1: never written)."""
        self.num_rows_read = 0
        """Rows gathered by `read` since start: the host work returning routing costs."""
        self._step: list[torch.Tensor | None] = [None] * len(self.routers)
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def record(module: nn.Module, args, output) -> None:
            indices = output[-1] if isinstance(output, tuple) else None
            if not isinstance(indices, torch.Tensor) or indices.is_floating_point():
                raise ModelLoadError(f"{type(module).__name__} does not return its top-k "
                                     "expert indices last: its routing cannot be recorded")
            self._step[layer] = indices.reshape(-1, indices.shape[-1])

        return record

    def store_step(self, slot_mapping: torch.Tensor) -> None:
        """After a forward: write its tokens' routing at their KV slots (padding: -1 slots)."""
        if any(indices is None for indices in self._step):
            raise RuntimeError("a MoE layer's router did not run in this step")
        routing = torch.stack(self._step, dim=1).to("cpu", torch.int16)  # [T, layers, k]
        self._step = [None] * len(self._step)
        slots = slot_mapping.to("cpu")
        written = slots >= 0
        self.store[slots[written]] = routing[written]

    def read(self, block_ids: Sequence[int], start: int, end: int) -> np.ndarray:
        """The routing of positions [start, end) of a request with this block table:
        [end - start, layers, top_k] int16 (a new array)."""
        first_block = start // self.block_size
        blocks = np.asarray(block_ids[first_block: -(-end // self.block_size)], dtype=np.int64)
        positions = np.arange(start, end)
        slots = (blocks[positions // self.block_size - first_block] * self.block_size
                 + positions % self.block_size)
        self.num_rows_read += end - start
        return self.store[torch.from_numpy(slots)].numpy()

    def read_new(self, rows: RoutedRows | None, block_ids: Sequence[int], end: int
                 ) -> RoutedRows:
        """`rows` (new ones if None) with positions [rows.num_rows, end) appended."""
        rows = RoutedRows() if rows is None else rows
        if end > rows.num_rows:
            rows.append(self.read(block_ids, rows.num_rows, end))
        return rows
