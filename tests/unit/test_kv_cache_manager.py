"""Tests for the KV cache manager: block tables, prefix-cache hits, allocation and freeing."""

from __future__ import annotations

from rollout_engine.core.kv_cache_manager import KVCacheManager, cdiv
from rollout_engine.core.request import Request
from tests.unit.factories import fresh_token_ids, make_request

BLOCK_SIZE = 4


def make_manager(num_blocks: int = 16, enable_prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)


def compute(manager: KVCacheManager, request: Request, num_new_tokens: int) -> None:
    """Allocate, advance the ledger, and cache once the step completed: one scheduler step."""
    manager.begin_step()
    assert manager.allocate_slots(request, num_new_tokens)
    request.num_computed_tokens += num_new_tokens
    manager.cache_blocks(request, request.num_computed_tokens)


def admit(manager: KVCacheManager, request: Request) -> int:
    """Admit a waiting request with its cache hits and compute the rest of its tokens."""
    manager.begin_step()
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)
    return num_hit_tokens


def test_cdiv() -> None:
    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_covers_the_positions_and_frees_them() -> None:
    manager = make_manager(num_blocks=8)
    request = make_request("a", num_prompt_tokens=10)
    compute(manager, request, 10)
    assert len(manager.get_block_ids("a")) == 3
    assert manager.num_free_blocks == 5
    compute(manager, request, 2)  # positions 10, 11 fit in the third block
    assert len(manager.get_block_ids("a")) == 3
    compute(manager, request, 1)
    assert len(manager.get_block_ids("a")) == 4
    manager.free(request)
    assert manager.get_block_ids("a") == [] and manager.num_free_blocks == 8


def test_allocation_failure_changes_nothing() -> None:
    manager = make_manager(num_blocks=4)
    big = make_request("big", num_prompt_tokens=12)
    compute(manager, big, 12)
    small = make_request("small", num_prompt_tokens=5)
    assert not manager.allocate_slots(small, 5)
    assert manager.get_block_ids("small") == []
    assert manager.num_free_blocks == 1
    assert manager.allocate_slots(small, 4)
    assert len(manager.get_block_ids("small")) == 1


def test_free_releases_tail_blocks_first() -> None:
    manager = make_manager(num_blocks=4)
    request = make_request("a", num_prompt_tokens=12)
    compute(manager, request, 12)
    block_ids = manager.get_block_ids("a")
    manager.free(request)
    assert list(manager.block_pool._free) == [3] + block_ids[::-1]


def test_blocks_are_cached_only_once_their_step_completed() -> None:
    """A step that fails between allocation and completion must leave nothing to hit."""
    manager = make_manager()
    prefix = fresh_token_ids(9)
    first = make_request("a", prefix + fresh_token_ids(1))
    assert manager.allocate_slots(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens  # scheduled, KV not written yet
    second = make_request("b", prefix + fresh_token_ids(5))
    # In the same step the blocks are shared (they are written before anyone reads them)...
    assert manager.get_computed_blocks(second)[1] == 8
    manager.begin_step()  # ... but the step failed: the next step must not see them.
    assert manager.get_computed_blocks(second) == ([], 0)
    assert manager.num_cached_tokens("a") == 0
    manager.cache_blocks(first, 6)  # only what is written: one full block
    assert manager.get_computed_blocks(second)[1] == 4
    manager.cache_blocks(first, first.num_tokens)
    assert manager.get_computed_blocks(second)[1] == 8 and manager.num_cached_tokens("a") == 8


def test_full_blocks_of_a_shared_prefix_are_hit() -> None:
    manager = make_manager()
    prefix = fresh_token_ids(9)
    first = make_request("a", prefix + fresh_token_ids(1))
    admit(manager, first)
    second = make_request("b", prefix + fresh_token_ids(5))
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 8
    assert [b.block_id for b in hits] == manager.get_block_ids("a")[:2]
    assert manager.allocate_slots(second, second.num_tokens - 8, hits)
    assert manager.get_block_ids("b")[:2] == manager.get_block_ids("a")[:2]
    assert [b.ref_count for b in hits] == [2, 2]


def test_partial_blocks_are_never_hit() -> None:
    manager = make_manager()
    prefix = fresh_token_ids(7)
    admit(manager, make_request("a", prefix + fresh_token_ids(3)))
    # Shares 7 tokens: only the first full block (4 tokens) matches.
    second = make_request("b", prefix + fresh_token_ids(3))
    assert manager.get_computed_blocks(second)[1] == 4


def test_the_last_token_is_never_served_from_cache() -> None:
    manager = make_manager()
    prompt = fresh_token_ids(8)
    admit(manager, make_request("a", prompt))
    assert manager.block_pool.num_cached_blocks == 2
    # Both blocks are cached, but the last token must be computed for its logits.
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("b", prompt))
    assert num_hit_tokens == 4 and len(hits) == 1
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("c", prompt + [1]))
    assert num_hit_tokens == 8 and len(hits) == 2


def test_hash_is_chained_so_a_block_only_hits_after_the_same_prefix() -> None:
    manager = make_manager()
    first_block, second_block = fresh_token_ids(4), fresh_token_ids(4)
    admit(manager, make_request("a", first_block + second_block + [1]))
    other = make_request("b", fresh_token_ids(4) + second_block + [1])
    assert manager.get_computed_blocks(other) == ([], 0)


def test_only_computed_positions_are_cached() -> None:
    manager = make_manager()
    prompt = fresh_token_ids(10)
    request = make_request("a", prompt)
    compute(manager, request, 5)
    assert manager.block_pool.num_cached_blocks == 1
    assert manager.get_computed_blocks(make_request("b", prompt))[1] == 4
    compute(manager, request, 5)
    assert manager.block_pool.num_cached_blocks == 2
    assert manager.get_computed_blocks(make_request("c", prompt))[1] == 8


def test_drafts_are_never_hashed() -> None:
    manager = make_manager()
    request = make_request("a", num_prompt_tokens=6)
    request.spec_token_ids = [7, 8]  # positions 6 and 7 complete the second block
    assert request.num_tokens_with_spec == 8
    compute(manager, request, 8)
    assert manager.block_pool.num_cached_blocks == 1
    second_block = manager.block_pool.blocks[manager.get_block_ids("a")[1]]
    assert second_block.block_hash is None
    copy = make_request("b", request.all_token_ids + [7, 8, 9])
    assert manager.get_computed_blocks(copy)[1] == 4


def test_committed_output_tokens_are_cached() -> None:
    manager = make_manager()
    request = make_request("a", num_prompt_tokens=6)
    compute(manager, request, 6)
    request.append_output_token(500, None)
    compute(manager, request, 1)
    request.append_output_token(501, None)
    assert manager.block_pool.num_cached_blocks == 1
    compute(manager, request, 1)  # position 7 (the token 501) fills the second block
    assert manager.block_pool.num_cached_blocks == 2
    follower = make_request("b", request.all_token_ids + [1])
    assert manager.get_computed_blocks(follower)[1] == 8


def test_a_request_with_computed_tokens_gets_no_hits() -> None:
    manager = make_manager()
    prompt = fresh_token_ids(9)
    admit(manager, make_request("a", prompt))
    follower = make_request("b", prompt)
    follower.num_computed_tokens = 1
    assert manager.get_computed_blocks(follower) == ([], 0)


def test_freed_cached_blocks_are_revived_by_an_identical_prefix() -> None:
    manager = make_manager(num_blocks=4)
    prompt = fresh_token_ids(9)
    first = make_request("a", prompt)
    admit(manager, first)
    first_ids = manager.get_block_ids("a")
    manager.free(first)
    assert manager.num_free_blocks == 4
    second = make_request("b", prompt)
    assert admit(manager, second) == 8
    assert manager.get_block_ids("b")[:2] == first_ids[:2]
    assert manager.num_free_blocks == 1


def test_revived_hits_count_against_the_free_blocks() -> None:
    manager = make_manager(num_blocks=4)
    prompt = fresh_token_ids(8)
    first = make_request("a", prompt + [1])
    admit(manager, first)
    manager.free(first)  # two cached blocks sit in the free queue
    # 8 hit tokens + 9 new positions need 5 blocks: the pool has 4.
    too_long = make_request("b", prompt + fresh_token_ids(9))
    hits, num_hit_tokens = manager.get_computed_blocks(too_long)
    assert num_hit_tokens == 8
    assert not manager.allocate_slots(too_long, 9, hits)
    assert manager.num_free_blocks == 4 and all(b.ref_count == 0 for b in hits)
    assert manager.block_pool.num_cached_blocks == 2
    # 8 hit tokens + 8 new positions need exactly the 4 blocks.
    fits = make_request("c", prompt + fresh_token_ids(8))
    hits, _ = manager.get_computed_blocks(fits)
    assert manager.allocate_slots(fits, 8, hits)
    assert manager.num_free_blocks == 0


def test_evicted_blocks_are_not_hit() -> None:
    manager = make_manager(num_blocks=3)
    prompt = fresh_token_ids(9)
    first = make_request("a", prompt)
    admit(manager, first)
    manager.free(first)
    # A new request takes all 3 blocks; tail blocks go first, yet all are needed.
    compute(manager, make_request("x", num_prompt_tokens=12), 12)
    assert manager.block_pool.num_cached_blocks == 3  # x's own blocks
    assert manager.get_computed_blocks(make_request("b", prompt))[1] == 0


def test_prefix_caching_disabled() -> None:
    manager = make_manager(enable_prefix_caching=False)
    prompt = fresh_token_ids(9)
    admit(manager, make_request("a", prompt))
    assert manager.block_pool.num_cached_blocks == 0
    assert manager.get_computed_blocks(make_request("b", prompt)) == ([], 0)


def test_reset_prefix_cache() -> None:
    manager = make_manager()
    prompt = fresh_token_ids(9)
    first = make_request("a", prompt)
    admit(manager, first)
    manager.reset_prefix_cache()
    assert manager.block_pool.num_cached_blocks == 0
    assert manager.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    manager.free(first)
    assert manager.num_free_blocks == manager.num_blocks
    # A prompt computed after the reset is cached again.
    admit(manager, make_request("c", prompt))
    assert manager.get_computed_blocks(make_request("d", prompt))[1] == 8
