"""Tests for the block pool: ref counts, the LRU free queue and the prefix-cache index."""

from __future__ import annotations

import pytest

from rollout_engine.core import block_pool as block_pool_module
from rollout_engine.core.block_pool import ROOT_HASH, RUN_BLOCKS, BlockPool, hash_block


def free_order(pool: BlockPool) -> list[int]:
    """Block ids in the order `allocate` will hand them out."""
    return list(pool._free)


def test_allocate_takes_blocks_in_order_and_sets_ref_counts() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_count == 1 for b in blocks)
    assert pool.num_free_blocks == 5
    assert free_order(pool) == [3, 4, 5, 6, 7]


def test_allocate_more_than_free_is_an_invariant_violation() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(AssertionError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_free_returns_blocks_to_the_tail_of_the_queue() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    pool.free(blocks)
    assert pool.num_free_blocks == 6
    assert free_order(pool) == [3, 4, 5, 0, 1, 2]
    assert all(b.ref_count == 0 for b in pool.blocks)


def test_shared_block_is_free_only_after_the_last_reference() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_count == 2
    pool.free([block])
    assert block.ref_count == 1 and pool.num_free_blocks == 3
    pool.free([block])
    assert block.ref_count == 0 and pool.num_free_blocks == 4


def test_double_free_is_caught() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([block])


def test_cache_and_lookup_a_full_block() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    block_hash = pool.cache(block, ROOT_HASH, [1, 2, 3, 4])
    assert block_hash == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert block.block_hash == block_hash and pool.num_cached_blocks == 1
    assert pool.lookup(ROOT_HASH, [1, 2, 3, 4]) is block
    assert pool.lookup(ROOT_HASH, [1, 2, 3, 5]) is None


def test_the_hash_is_chained_on_the_parent() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    first_hash = pool.cache(first, ROOT_HASH, [1, 2])
    pool.cache(second, first_hash, [3, 4])
    assert pool.lookup(first_hash, [3, 4]) is second
    # The same tokens after another prefix are another block.
    assert pool.lookup(ROOT_HASH, [3, 4]) is None
    assert pool.lookup(hash_block(ROOT_HASH, [9, 9]), [3, 4]) is None


def test_lookup_checks_tokens_not_only_the_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every block hashes alike: only the token-equality check tells them apart.
    monkeypatch.setattr(block_pool_module, "hash_block", lambda parent, tokens: 7)
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.cache(block, ROOT_HASH, [1, 2])
    assert pool.lookup(ROOT_HASH, [1, 2]) is block
    assert pool.lookup(ROOT_HASH, [3, 4]) is None


def test_caching_disabled_indexes_nothing() -> None:
    pool = BlockPool(4, enable_caching=False)
    (block,) = pool.allocate(1)
    block_hash = pool.cache(block, ROOT_HASH, [1, 2])
    assert block_hash == hash_block(ROOT_HASH, [1, 2])
    assert block.block_hash is None and pool.num_cached_blocks == 0
    assert pool.lookup(ROOT_HASH, [1, 2]) is None


def test_a_second_block_with_the_same_prefix_is_not_indexed() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    pool.cache(first, ROOT_HASH, [1, 2])
    pool.cache(second, ROOT_HASH, [1, 2])
    assert second.block_hash is None
    assert pool.lookup(ROOT_HASH, [1, 2]) is first
    assert pool.num_cached_blocks == 1


def test_freed_cached_block_stays_cached_and_is_revived_by_touch() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.cache(block, ROOT_HASH, [1, 2])
    pool.free([block])
    assert pool.num_free_blocks == 4
    hit = pool.lookup(ROOT_HASH, [1, 2])
    assert hit is block
    pool.touch([hit])
    assert block.ref_count == 1 and pool.num_free_blocks == 3
    assert block.block_id not in free_order(pool)


def test_reusing_a_cached_free_block_evicts_its_prefix() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, ROOT_HASH, [1])
    pool.cache(b, ROOT_HASH, [2])
    pool.free([b, a])  # b is freed first, so it is evicted first
    (reused,) = pool.allocate(1)
    assert reused is b
    assert reused.block_hash is None and reused.token_ids == ()
    assert pool.lookup(ROOT_HASH, [2]) is None
    assert pool.lookup(ROOT_HASH, [1]) is a
    assert pool.num_cached_blocks == 1


def test_eviction_is_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.cache(block, ROOT_HASH, [i])
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[1]])
    # Reviving block 0 and freeing it again moves it to the back of the queue.
    pool.touch([pool.lookup(ROOT_HASH, [0])])
    pool.free([blocks[0]])
    assert free_order(pool) == [2, 1, 0]
    assert [b.block_id for b in pool.allocate(2)] == [2, 1]
    assert pool.lookup(ROOT_HASH, [0]) is blocks[0]
    assert pool.lookup(ROOT_HASH, [1]) is None and pool.lookup(ROOT_HASH, [2]) is None


def test_reset_prefix_cache_forgets_everything_and_keeps_ref_counts() -> None:
    pool = BlockPool(4)
    used, freed = pool.allocate(2)
    pool.cache(used, ROOT_HASH, [1])
    pool.cache(freed, ROOT_HASH, [2])
    pool.free([freed])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert pool.lookup(ROOT_HASH, [1]) is None and pool.lookup(ROOT_HASH, [2]) is None
    assert used.block_hash is None and freed.block_hash is None
    assert used.ref_count == 1 and pool.num_free_blocks == 3
    # Blocks can be cached again afterwards.
    pool.cache(used, ROOT_HASH, [1])
    assert pool.lookup(ROOT_HASH, [1]) is used


def test_requests_growing_in_turn_each_get_consecutive_ids() -> None:
    # Two requests taking a block each in turn, as decoding sequences do: without runs their
    # ids would alternate (0, 2, 4 / 1, 3, 5) and the CPU attention would read them scattered.
    pool = BlockPool(4 * RUN_BLOCKS)
    tables: list[list[int]] = [[], []]
    for _ in range(RUN_BLOCKS + 2):
        for table in tables:
            after = table[-1] if table else None
            table += [b.block_id for b in pool.allocate(1, after=after)]
    first, second = tables
    assert first[:RUN_BLOCKS] == list(range(RUN_BLOCKS))
    assert second[:RUN_BLOCKS] == list(range(RUN_BLOCKS, 2 * RUN_BLOCKS))
    # Past its run a request goes on after the other's run, and its next run is kept for it.
    assert first[RUN_BLOCKS:] == [2 * RUN_BLOCKS, 2 * RUN_BLOCKS + 1]
    assert second[RUN_BLOCKS:] == [3 * RUN_BLOCKS, 3 * RUN_BLOCKS + 1]


def test_a_run_never_takes_a_cached_block_out_of_its_turn() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    pool.cache(blocks[1], ROOT_HASH, [1])
    pool.free(blocks[1:])  # block 1 cached and free, block 2 free
    (nxt,) = pool.allocate(1, after=0)
    assert nxt.block_id != 1 and pool.lookup(ROOT_HASH, [1]) is blocks[1]


def test_kept_back_blocks_still_serve_when_the_pool_runs_short() -> None:
    pool = BlockPool(2 * RUN_BLOCKS)
    taken = [pool.allocate(1)[0] for _ in range(2 * RUN_BLOCKS)]  # no request continues
    assert sorted(b.block_id for b in taken) == list(range(2 * RUN_BLOCKS))
    assert pool.num_free_blocks == 0
