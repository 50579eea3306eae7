"""The paged KV cache's shape per layer, its size, and the cache itself as the model reads it.

Layers need not agree: each has its own KV heads, K and V head dims (multi-head latent
attention stores 192-wide keys and 128-wide values), sliding window, and may read another
layer's KV instead of holding its own (Gemma 3n's shared layers). A block id names the same
positions in every layer, so the scheduler's ledger and prefix cache stay one for the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kernels import KVCacheLayout
from rollout_engine.config import CacheConfig
from rollout_engine.worker.models.decoder import head_dim_of, sliding_windows_of
from rollout_engine.worker.models.tp_sharding import num_local_kv_heads


@dataclass(frozen=True)
class LayerKVSpec:
    """One attention layer's KV: [num_blocks, block_size, num_kv_heads, *_head_dim]."""

    num_kv_heads: int
    key_head_dim: int
    value_head_dim: int
    sliding_window: int | None = None
    """Each token sees its own key and the `sliding_window - 1` before it (None: all)."""
    kv_source_layer: int | None = None
    """The earlier layer whose KV this layer reads and never writes (None: its own)."""

    @property
    def owns_kv(self) -> bool:
        return self.kv_source_layer is None

    @property
    def elements_per_token(self) -> int:
        """K and V elements one token takes in this layer (0 when it reads another's)."""
        return self.num_kv_heads * (self.key_head_dim + self.value_head_dim) if self.owns_kv else 0


@dataclass(frozen=True)
class KVCacheSpec:
    """One model's KV cache: a [num_blocks, block_size, ...] key and value cache per layer."""

    block_size: int
    dtype: torch.dtype
    layers: tuple[LayerKVSpec, ...]

    def __post_init__(self) -> None:
        for i, layer in enumerate(self.layers):
            source = layer.kv_source_layer
            assert source is None or (0 <= source < i and self.layers[source].owns_kv), (i, source)

    @classmethod
    def from_model(
        cls, hf_config, block_size: int, dtype: torch.dtype, tp_size: int = 1
    ) -> KVCacheSpec:
        """The native decoder's: every layer alike but for its window; with tensor parallelism
        only one rank's KV heads."""
        num_kv_heads, head_dim = num_local_kv_heads(hf_config, tp_size), head_dim_of(hf_config)
        layers = tuple(
            LayerKVSpec(num_kv_heads, head_dim, head_dim, window)
            for window in sliding_windows_of(hf_config)
        )
        return cls(block_size, dtype, layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def owner_layers(self) -> list[int]:
        """The layers that hold KV of their own, in order."""
        return [i for i, layer in enumerate(self.layers) if layer.owns_kv]

    @property
    def num_kv_heads(self) -> int:
        """The KV heads of every layer; ValueError if they differ (ask `layers` then)."""
        counts = {layer.num_kv_heads for layer in self.layers}
        if len(counts) != 1:
            raise ValueError(f"the layers have different numbers of KV heads: {sorted(counts)}")
        return counts.pop()

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers."""
        elements = sum(layer.elements_per_token for layer in self.layers)
        return elements * self.dtype.itemsize

    @property
    def block_nbytes(self) -> int:
        return self.block_size * self.bytes_per_token

    def num_blocks_for(self, cache_config: CacheConfig, kv_cache_bytes: int) -> int:
        """`num_blocks` if set, else as many blocks as `kv_cache_bytes` holds."""
        if cache_config.num_blocks is not None:
            return cache_config.num_blocks
        return max(1, kv_cache_bytes // self.block_nbytes)

    def num_elements(self, num_blocks: int) -> int:
        """Elements of the whole cache of `num_blocks` blocks."""
        return num_blocks * self.block_size * self.bytes_per_token // self.dtype.itemsize

    def describe(self) -> list[list]:
        """Per layer what must be equal for two engines' KV to be interchangeable."""
        return [[layer.num_kv_heads, layer.key_head_dim, layer.value_head_dim,
                 layer.kv_source_layer] for layer in self.layers]


class PagedKVCache:
    """The KV cache the model and kernels read: per layer a (key_cache, value_cache) pair of
    logical [num_blocks, block_size, Hkv, D] views into one flat tensor.

    The flat tensor (the "kv_cache" pool's only tenant) holds, layer after layer, each owning
    layer's keys then values in the backend's order (`KVCacheLayout`: heads-major on the CPU).
    For a model whose layers agree that is the memory of one [L, 2, ...] tensor. A layer that
    shares another's KV gets that layer's pair.
    """

    def __init__(
        self, storage: torch.Tensor, spec: KVCacheSpec, layout: KVCacheLayout, num_blocks: int
    ) -> None:
        assert storage.dim() == 1 and storage.numel() == spec.num_elements(num_blocks)
        self.storage = storage
        self.spec = spec
        self.num_blocks = num_blocks
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        offset = 0
        for layer in spec.layers:
            if not layer.owns_kv:
                pairs.append(pairs[layer.kv_source_layer])
                continue
            caches = []
            for head_dim in (layer.key_head_dim, layer.value_head_dim):
                shape = layout.cache_storage_shape(
                    num_blocks, spec.block_size, layer.num_kv_heads, head_dim
                )
                numel = num_blocks * spec.block_size * layer.num_kv_heads * head_dim
                caches.append(layout.cache_logical_view(storage[offset : offset + numel].view(shape)))
                offset += numel
            pairs.append((caches[0], caches[1]))
        self.layers = pairs

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of a layer: [num_blocks, block_size, Hkv, Dk / Dv]."""
        return self.layers[layer]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def device(self) -> torch.device:
        return self.storage.device

    def data_ptr(self) -> int:
        """Address of the whole cache; stable across sleep and wake."""
        return self.storage.data_ptr()

    # ------------------------------------------------------------------ token-order copies
    def _owned(self) -> Iterator[torch.Tensor]:
        """Every cache tensor that holds data, in payload order: per owning layer K, then V."""
        for i in self.spec.owner_layers:
            yield from self.layers[i]

    def read_tokens(self, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
        """The KV of positions [0, num_tokens) of the sequence in `block_ids`, as one new flat
        tensor: per owning layer its keys [num_tokens, Hkv, Dk] then values [.., Dv]."""
        bs = self.spec.block_size
        ids = torch.tensor(list(block_ids[: -(-num_tokens // bs)]), device=self.device)
        parts = [
            cache.index_select(0, ids).flatten(0, 1)[:num_tokens].reshape(-1)  # [n * Hkv * D]
            for cache in self._owned()
        ]
        return torch.cat(parts)

    def token_payload_numel(self, num_tokens: int) -> int:
        """Elements of `read_tokens(..., num_tokens)`'s result."""
        return num_tokens * self.spec.bytes_per_token // self.spec.dtype.itemsize

    def write_tokens(
        self, block_ids: Sequence[int], payload: torch.Tensor, num_tokens: int, start: int,
        count: int,
    ) -> None:
        """Write positions [start, start + count) of a `read_tokens` payload of `num_tokens`
        positions into the sequence whose blocks are `block_ids` (positions from 0)."""
        bs = self.spec.block_size
        first_block, num_blocks = start // bs, -(-(start + count) // bs) - start // bs
        assert start % bs == 0, "a load starts at a block boundary"
        ids = torch.tensor(list(block_ids[first_block : first_block + num_blocks]),
                           device=self.device)
        offset = 0
        for cache in self._owned():
            row = cache.shape[2] * cache.shape[3]  # Hkv * D
            rows = payload[offset : offset + num_tokens * row].view(num_tokens, *cache.shape[2:])
            offset += num_tokens * row
            data = rows[start : start + count].to(self.device)  # [count, Hkv, D]
            num_full = count // bs
            if num_full:
                cache[ids[:num_full]] = data[: num_full * bs].view(num_full, bs, *cache.shape[2:])
            tail = count - num_full * bs
            if tail:
                cache[ids[num_full], :tail] = data[num_full * bs :]


DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024**2


def plan_kv_cache_bytes(
    total_bytes: int, free_bytes: int, engine_bytes: int, activation_bytes: int,
    utilization: float,
) -> int:
    """KV bytes on a GPU: the engine may use `utilization` of the device in all, of which its
    weights (`engine_bytes`, already allocated) and the activations of the largest step take
    their share; never more than is free now, leaving room for those activations."""
    budget = int(utilization * total_bytes) - engine_bytes - activation_bytes
    budget = min(budget, free_bytes - activation_bytes)
    if budget <= 0:
        raise ValueError(
            f"no room for a KV cache: gpu_memory_utilization={utilization} of "
            f"{total_bytes / 2**30:.1f} GiB is {utilization * total_bytes / 2**30:.2f} GiB, the "
            f"weights take {engine_bytes / 2**30:.2f} GiB and activations about "
            f"{activation_bytes / 2**30:.2f} GiB ({free_bytes / 2**30:.2f} GiB free now); raise "
            "gpu_memory_utilization, free device memory, or set kv_cache_bytes"
        )
    return budget


def activation_bytes_estimate(hf_config, max_num_batched_tokens: int, max_num_seqs: int,
                              dtype: torch.dtype) -> int:
    """A generous bound on one step's transient memory: per-token hidden and MLP activations,
    plus fp32 logits and their softmax for every sampled row (drafts included). A config
    without `intermediate_size` (GPT-2, OPT) is taken to have the usual 4 x hidden."""
    hidden = hf_config.hidden_size
    intermediate = getattr(hf_config, "intermediate_size", None) or 4 * hidden
    per_token = (8 * hidden + 3 * intermediate) * dtype.itemsize
    logits = 3 * max_num_seqs * 8 * hf_config.vocab_size * 4
    return max_num_batched_tokens * per_token + logits
