"""The CPU attention path (batched, cascade over shared prefixes) equals the reference."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.paged_attention_cpu import paged_attention_cpu
from kernels.paged_attention_ref import paged_attention_ref

BLOCK_SIZE = 4


def make_batch(rng: random.Random, num_groups: int, shared: bool, num_blocks: int = 400):
    """Requests in groups that share leading blocks (like n samples of one prompt)."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    query_lens, seq_lens, tables = [], [], []
    for _ in range(num_groups):
        prefix_blocks = [free.pop() for _ in range(rng.randint(0, 6))] if shared else []
        for _ in range(rng.randint(1, 5)):
            seq_len = len(prefix_blocks) * BLOCK_SIZE + rng.randint(1, 30)
            q_len = rng.choice([1, 1, 1, 3, 5, 20])
            q_len = min(q_len, seq_len - len(prefix_blocks) * BLOCK_SIZE) if prefix_blocks else (
                min(q_len, seq_len))
            own = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE) - len(prefix_blocks))]
            query_lens.append(q_len)
            seq_lens.append(seq_len)
            tables.append(prefix_blocks + own)
    return AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shared", [True, False])
def test_cpu_path_matches_reference(seed, shared):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    metadata = make_batch(rng, num_groups=6, shared=shared)
    num_heads, num_kv_heads, head_dim = 4, 2, 8
    key_cache = torch.randn(400, BLOCK_SIZE, num_kv_heads, head_dim)
    value_cache = torch.randn(400, BLOCK_SIZE, num_kv_heads, head_dim)
    query = torch.randn(sum(metadata.query_lens_cpu), num_heads, head_dim)
    expected = paged_attention_ref(query, key_cache, value_cache, metadata, 0.3)
    got = paged_attention_cpu(query, key_cache, value_cache, metadata, 0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    plan = metadata.cache["cpu_plan"]
    assert (plan["shared"] is not None) == shared, "the shared-prefix path should be exercised"


def test_shared_prefix_is_used_for_sibling_decodes():
    # 8 decode rows over the same 5 leading blocks: one shared group.
    prefix = [10, 11, 12, 13, 14]
    tables = [prefix + [20 + i, 40 + i] for i in range(8)]
    metadata = AttentionMetadata.build([1] * 8, [27] * 8, tables, BLOCK_SIZE)
    torch.manual_seed(0)
    key_cache, value_cache = torch.randn(2, 64, BLOCK_SIZE, 2, 8).unbind(0)
    query = torch.randn(8, 4, 8)
    got = paged_attention_cpu(query, key_cache, value_cache, metadata, 0.35)
    expected = paged_attention_ref(query, key_cache, value_cache, metadata, 0.35)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    plan = metadata.cache["cpu_plan"]
    assert plan["shared"] is not None and plan["shared"].tables.shape == (1, 5)
    assert plan["own"].tables.shape == (8, 2)  # each row gathers only its own 2 blocks


@pytest.mark.parametrize("seed", range(3))
def test_heads_major_cache_gives_the_same_store_and_attention(seed):
    """The engine's CPU cache is stored [Hkv, num_blocks, bs, D] behind the usual view."""
    from kernels import kv_cache_layout
    from kernels.dispatch import store_kv_cache
    from kernels.paged_attention_ref import store_kv_cache_ref

    rng = random.Random(seed)
    torch.manual_seed(seed)
    metadata = make_batch(rng, num_groups=5, shared=True)
    layout = kv_cache_layout(torch.device("cpu"))
    assert layout.heads_major
    dims = dict(num_layers=1, num_blocks=400, block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=8)
    storage = torch.zeros(layout.storage_shape(**dims))
    heads_major = layout.logical_view(storage)[0]  # [2, N, bs, Hkv, D]
    plain = torch.zeros(kv_cache_layout(torch.device("cuda")).storage_shape(**dims))[0]
    assert heads_major.shape == plain.shape and not heads_major.is_contiguous()
    num_tokens = sum(metadata.query_lens_cpu)
    key, value = torch.randn(2, num_tokens, 2, 8).unbind(0)
    store_kv_cache(key, value, heads_major[0], heads_major[1], metadata.slot_mapping)
    store_kv_cache_ref(key, value, plain[0], plain[1], metadata.slot_mapping)
    torch.testing.assert_close(heads_major, plain, rtol=0, atol=0)
    query = torch.randn(num_tokens, 4, 8)
    got = paged_attention_cpu(query, heads_major[0], heads_major[1], metadata, 0.3)
    expected = paged_attention_ref(query, plain[0], plain[1], metadata, 0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # The reference itself also accepts the strided view.
    torch.testing.assert_close(
        paged_attention_ref(query, heads_major[0], heads_major[1], metadata, 0.3), expected,
        atol=1e-6, rtol=1e-6,
    )
