"""The KV cache from per-layer specs: sizes, where each layer's caches lie, shared layers, and
token-order copies for KV transfer."""

from __future__ import annotations

import pytest
import torch

from kernels import KVCacheLayout
from rollout_engine.config import CacheConfig
from rollout_engine.worker.kv_cache_spec import KVCacheSpec, LayerKVSpec, PagedKVCache

BLOCK_SIZE = 4
LAYOUTS = [KVCacheLayout(heads_major=True), KVCacheLayout(heads_major=False)]
# Multi-head latent attention's K/V widths, a sliding layer, a layer reading layer 1's KV.
MIXED = (
    LayerKVSpec(num_kv_heads=2, key_head_dim=12, value_head_dim=8),
    LayerKVSpec(num_kv_heads=1, key_head_dim=16, value_head_dim=16, sliding_window=6),
    LayerKVSpec(num_kv_heads=4, key_head_dim=8, value_head_dim=8),
    LayerKVSpec(num_kv_heads=1, key_head_dim=16, value_head_dim=16, sliding_window=6,
                kv_source_layer=1),
)


def make_cache(layers, layout: KVCacheLayout, num_blocks: int = 6) -> PagedKVCache:
    spec = KVCacheSpec(BLOCK_SIZE, torch.float32, tuple(layers))
    storage = torch.zeros(spec.num_elements(num_blocks))
    return PagedKVCache(storage, spec, layout, num_blocks)


def test_sizes_count_only_layers_holding_kv():
    spec = KVCacheSpec(BLOCK_SIZE, torch.bfloat16, MIXED)
    elements_per_token = 2 * (12 + 8) + 1 * (16 + 16) + 4 * (8 + 8)  # layer 3 holds nothing
    assert spec.bytes_per_token == elements_per_token * 2
    assert spec.block_nbytes == BLOCK_SIZE * elements_per_token * 2
    assert spec.owner_layers == [0, 1, 2]
    assert spec.num_blocks_for(CacheConfig(), kv_cache_bytes=10 * spec.block_nbytes + 1) == 10
    with pytest.raises(ValueError):
        spec.num_kv_heads  # noqa: B018 - the layers disagree: no single answer


@pytest.mark.parametrize("layout", LAYOUTS, ids=["heads_major", "block_major"])
def test_layers_that_agree_lie_as_one_stacked_tensor(layout):
    """The memory of [L, 2, ...] in the backend's order, as before per-layer specs."""
    num_layers, num_blocks, num_kv_heads, head_dim = 3, 5, 2, 8
    layers = [LayerKVSpec(num_kv_heads, head_dim, head_dim)] * num_layers
    cache = make_cache(layers, layout, num_blocks)
    stacked = layout.logical_view(cache.storage.view(
        layout.storage_shape(num_layers, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    ))
    for layer in range(num_layers):
        for k_or_v in range(2):
            view = cache[layer][k_or_v]
            assert view.shape == (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
            assert view.data_ptr() == stacked[layer, k_or_v].data_ptr()
            assert view.stride() == stacked[layer, k_or_v].stride()


@pytest.mark.parametrize("layout", LAYOUTS, ids=["heads_major", "block_major"])
def test_each_layer_has_caches_of_its_own_shape_and_a_shared_layer_its_sources(layout):
    cache = make_cache(MIXED, layout)
    for layer, (key_cache, value_cache) in zip(MIXED, cache):
        assert key_cache.shape == (6, BLOCK_SIZE, layer.num_kv_heads, layer.key_head_dim)
        assert value_cache.shape == (6, BLOCK_SIZE, layer.num_kv_heads, layer.value_head_dim)
        assert key_cache.stride(-1) == value_cache.stride(-1) == 1
    assert cache[3][0] is cache[1][0] and cache[3][1] is cache[1][1]
    # Owned caches do not overlap and fill the storage: mark each, every element once.
    for i, (key_cache, value_cache) in enumerate(list(cache)[:3]):
        key_cache.add_(2 * i + 1)
        value_cache.add_(2 * i + 2)
    counts = torch.bincount(cache.storage.long())
    sizes = [c.numel() for layer in list(cache)[:3] for c in layer]
    assert counts[1:].tolist() == sizes and counts[0] == 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=["heads_major", "block_major"])
def test_token_copies_move_a_sequence_between_caches_whatever_its_blocks(layout):
    source, target = make_cache(MIXED, layout), make_cache(MIXED, layout)
    torch.manual_seed(0)
    source.storage.copy_(torch.randn_like(source.storage))
    num_tokens, source_blocks, target_blocks = 10, [4, 0, 2], [1, 5, 3]
    payload = source.read_tokens(source_blocks, num_tokens)
    assert payload.shape == (source.token_payload_numel(num_tokens),)
    # In two loads: the first block, then the rest with its partial tail.
    target.write_tokens(target_blocks, payload, num_tokens, start=0, count=BLOCK_SIZE)
    target.write_tokens(target_blocks, payload, num_tokens, start=BLOCK_SIZE,
                        count=num_tokens - BLOCK_SIZE)
    for (src_k, src_v), (dst_k, dst_v) in zip(source, target):
        for src, dst in ((src_k, dst_k), (src_v, dst_v)):
            expected = src[source_blocks].flatten(0, 1)[:num_tokens]
            torch.testing.assert_close(dst[target_blocks].flatten(0, 1)[:num_tokens], expected,
                                       rtol=0, atol=0)
            assert dst[target_blocks].flatten(0, 1)[num_tokens:].abs().sum() == 0
    untouched = [b for b in range(6) if b not in target_blocks]
    assert all(c[untouched].abs().sum() == 0 for layer in target for c in layer)


def test_a_shared_layer_must_read_an_earlier_layer_holding_kv():
    with pytest.raises(AssertionError):
        KVCacheSpec(BLOCK_SIZE, torch.float32, (MIXED[0], MIXED[3]))
