"""Ref-counted KV blocks, the free queue (LRU order) and the prefix-cache index. No torch."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# The parent hash of a request's first block (of the base model's: see `root_hash`).
ROOT_HASH = 0

RUN_BLOCKS = 32
"""A request's blocks come in runs of up to this many consecutive ids where the pool allows
(`BlockPool.allocate`). Measured in the engine (8 x 8 samples to 2,048 new tokens, float32,
16-token blocks, 2 threads): 767 tok/s without runs, 809 with runs of 8, 817 with 32."""


def root_hash(lora_id: int) -> int:
    """The parent hash of the first block of a request running under LoRA adapter `lora_id`
    (0: the base model): a prefix's KV is shared only by requests of one adapter."""
    return ROOT_HASH if not lora_id else hash(("lora", lora_id))


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: depends on every token before it."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass
class KVBlock:
    """One fixed-size block of KV slots."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    """Set while the block is in the prefix-cache index."""
    parent_hash: int = ROOT_HASH
    token_ids: tuple[int, ...] = ()
    """The block's tokens, kept for the equality check on a cache hit."""


class BlockPool:
    """Owns every block: allocation, ref counts, and the prefix-cache index.

    Free blocks sit in an LRU queue; a freed block that holds a cached prefix keeps its
    hash until it is reused, so a later request with the same prefix can revive it.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0, f"num_blocks must be positive, got {num_blocks}"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Block ids in eviction order: the first is reused first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, num_blocks: int, after: int | None = None) -> list[KVBlock]:
        """Take `num_blocks` blocks from the free queue (evicting cached content).

        `after` is the id of the request's last block: the new blocks continue it where the
        pool allows. The CPU attention reads a request's blocks fastest when they are
        consecutive ids (heads-major storage makes them one run of memory per KV head: a decode
        step's attention over 8 x 8 sequences at a 4,096-token context, 23 ms against 33 ms for
        scattered 16-token blocks, `benchmarks.cpu_attention --placement engine scattered`),
        but requests that grow in step would take turns with the ids. So each block is the id
        after the previous one when that id is free and holds no cached prefix; otherwise the
        queue's head, and up to RUN_BLOCKS - 1 ids after it that are free and uncached move to
        the queue's tail, left for this request's next blocks unless the pool needs them first.
        Uncached free blocks hold nothing worth keeping, but moving them back means a cached
        block ahead of them is reused sooner under memory pressure.
        """
        assert num_blocks <= len(self._free), f"need {num_blocks}, have {len(self._free)} free"
        allocated = []
        for _ in range(num_blocks):
            block_id = self._take_free(after)
            after = block_id
            block = self.blocks[block_id]
            assert block.ref_count == 0, f"free block {block_id} has ref_count {block.ref_count}"
            self._evict(block)
            block.ref_count = 1
            allocated.append(block)
        return allocated

    def _take_free(self, after: int | None) -> int:
        """A free block's id, out of the queue: `after + 1` if it is free and uncached, else
        the queue's head, its next ids kept back for the same request (see `allocate`)."""
        if after is not None and self._is_free_and_uncached(after + 1):
            del self._free[after + 1]
            return after + 1
        block_id, _ = self._free.popitem(last=False)
        for next_id in range(block_id + 1, min(block_id + RUN_BLOCKS, self.num_blocks)):
            if not self._is_free_and_uncached(next_id):
                break
            self._free.move_to_end(next_id)
        return block_id

    def _is_free_and_uncached(self, block_id: int) -> bool:
        return block_id in self._free and self.blocks[block_id].block_hash is None

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference to each block; blocks reaching zero go to the queue's tail.

        Callers pass a request's blocks in reverse so its tail blocks, least likely to be
        shared, are evicted first.
        """
        for block in blocks:
            assert block.ref_count > 0, f"double free of block {block.block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference to cache-hit blocks, reviving free ones."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def lookup(self, parent_hash: int, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block holding exactly these tokens after this prefix, if any."""
        block_hash = hash_block(parent_hash, token_ids)
        block = self._cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash:
            return None
        if block.token_ids != tuple(token_ids):
            return None
        return block

    def cache(self, block: KVBlock, parent_hash: int, token_ids: Sequence[int]) -> int:
        """Index a full block under its chained hash; returns the hash."""
        block_hash = hash_block(parent_hash, token_ids)
        if not self.enable_caching or block.block_hash is not None:
            return block_hash
        if block_hash in self._cached:
            # Another block already holds this prefix (computed in parallel); keep that one.
            return block_hash
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        return block_hash

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (weights changed or KV memory was released)."""
        for block in self._cached.values():
            block.block_hash = None
            block.token_ids = ()
        self._cached.clear()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
