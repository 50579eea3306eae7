"""Megatron-style parallel layers: column/row-parallel linears, vocab-parallel embedding and
lm_head. Each holds only its rank's shard; parameter names stay those of nn.Linear and
nn.Embedding, so the checkpoint's names still apply. At tensor_parallel_size 1 each is the
plain layer (same shapes, same arithmetic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout_engine.worker.models.packed_linear import PackedLinear
from rollout_engine.worker.models.tp_sharding import ShardSpec, vocab_shard
from rollout_engine.worker.tp.tp_group import TPGroup


class ColumnParallelLinear(nn.Linear):
    """Output rows [start, start + size) of the full [out_features, in_features] linear (and
    of its bias); the output stays split across ranks."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, rows: tuple[int, int], tp: TPGroup
    ) -> None:
        super().__init__(in_features, rows[1], bias=bias)
        self.full_shape = (out_features, in_features)
        self.rows = rows
        self.tp_size = tp.size

    def param_shard_specs(self) -> dict[str, ShardSpec]:
        """Parameter name -> its slice of the checkpoint tensor."""
        out_features, in_features = self.full_shape
        if self.tp_size == 1:
            return _replicated(self)
        start, size = self.rows
        specs = {"weight": ShardSpec((out_features, in_features), 0, start, size)}
        if self.bias is not None:
            specs["bias"] = ShardSpec((out_features,), 0, start, size)
        return specs


class RowParallelLinear(nn.Linear):
    """Input columns [start, start + size) of the full linear: each rank's partial product is
    summed over the ranks (all-reduce), then the bias, held whole, is added once."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, cols: tuple[int, int], tp: TPGroup
    ) -> None:
        super().__init__(cols[1], out_features, bias=bias)
        self.full_shape = (out_features, in_features)
        self.cols = cols
        self.tp = tp
        self.packed: PackedLinear | None = None
        """CPU: the weight packed for oneDNN (`packed_linear.py`); with the bias at size 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias) if self.packed is None else self.packed(x)
        partial = F.linear(x, self.weight) if self.packed is None else self.packed(x)
        out = self.tp.all_reduce(partial)  # [T, out_features]
        return out if self.bias is None else out + self.bias

    def param_shard_specs(self) -> dict[str, ShardSpec]:
        if self.tp.size == 1:
            return _replicated(self)
        start, size = self.cols
        specs = {"weight": ShardSpec(self.full_shape, 1, start, size)}
        if self.bias is not None:
            specs["bias"] = ShardSpec((self.full_shape[0],), None)
        return specs


class VocabParallelEmbedding(nn.Embedding):
    """Rows of the vocabulary slice `vocab_shard` gives this rank; ids outside it look up
    zeros, and the all-reduce fills every row from the rank that holds it."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        self.shard = vocab_shard(vocab_size, tp.size, tp.rank)
        # Uninitialised: the loader fills it. (Embedding's own random init on the meta device
        # runs through torch's reference ops, whose first call imports torch._dynamo: 0.6 s.)
        super().__init__(self.shard.num_rows, hidden_size,
                         _weight=torch.empty(self.shard.num_rows, hidden_size))
        self.full_shape = (vocab_size, hidden_size)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        start = self.shard.start
        is_outside = (input_ids < start) | (input_ids >= start + self.shard.size)  # [T]
        local_ids = (input_ids - start).masked_fill(is_outside, 0)
        hidden = F.embedding(local_ids, self.weight)  # [T, hidden]
        hidden.masked_fill_(is_outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)

    def param_shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": _vocab_spec(self.full_shape, self.shard, self.tp.size)}


class ParallelLMHead(nn.Linear):
    """The lm_head's rows of this rank's vocabulary slice; `logits()` all-gathers them."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup) -> None:
        self.shard = vocab_shard(vocab_size, tp.size, tp.rank)
        super().__init__(hidden_size, self.shard.num_rows, bias=False)
        self.full_shape = (vocab_size, hidden_size)
        self.tp = tp

    def param_shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": _vocab_spec(self.full_shape, self.shard, self.tp.size)}


def vocab_parallel_logits(
    hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: TPGroup,
    packed: PackedLinear | None = None,
) -> torch.Tensor:
    """hidden: [R, hidden], weight: this rank's [num_rows, hidden] -> float32 [R, vocab_size]
    on every rank (the shards' logits all-gathered, padding columns dropped). `packed`: the
    same weight packed for oneDNN (CPU)."""
    local = (F.linear(hidden, weight) if packed is None else packed(hidden)).float()
    if tp.size == 1:
        return local
    return tp.all_gather(local, dim=-1)[:, :vocab_size]  # [R, tp.size * num_rows] -> [R, V]


def _vocab_spec(full_shape: tuple[int, int], shard, tp_size: int) -> ShardSpec:
    if tp_size == 1:
        return ShardSpec(full_shape)
    return ShardSpec(full_shape, 0, shard.start, shard.size)


def _replicated(module: nn.Module) -> dict[str, ShardSpec]:
    return {
        name: ShardSpec(tuple(p.shape)) for name, p in module.named_parameters(recurse=False)
    }
