"""Maps requests to KV blocks: allocation, prefix-cache hits and freeing. No torch."""

from __future__ import annotations

from collections.abc import Sequence

from rollout_engine.block_pool import ROOT_HASH, BlockPool, KVBlock
from rollout_engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns each request's block table; hides the block pool behind a few verbs."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        # Chained hashes of each request's blocks indexed so far (prefix caching).
        self._block_hashes: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks matching the request's tokens.

        The last token is never served from cache: its logits are needed.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return [], 0
        bs = self.block_size
        max_hit_blocks = (request.num_tokens - 1) // bs
        parent_hash, hits = ROOT_HASH, []
        for i in range(max_hit_blocks):
            block = self.block_pool.lookup(parent_hash, request.all_token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
            parent_hash = block.block_hash
        return hits, len(hits) * bs

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> bool:
        """Make room for `num_new_tokens` more positions (drafts included).

        Returns False, changing nothing, when the pool has too few free blocks.
        """
        blocks = self._blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        num_needed = cdiv(num_total, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Cache hits sitting in the free queue stop being free once touched.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_count == 0)
        if num_needed > self.block_pool.num_free_blocks - num_revived:
            if not blocks:
                del self._blocks[request.request_id]
            return False
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if num_needed > 0:
            blocks.extend(self.block_pool.allocate(num_needed))
        if self.enable_prefix_caching:
            # Only committed tokens are hashed, never drafts.
            self._cache_full_blocks(request, blocks, min(num_total, request.num_tokens))
        return True

    def free(self, request: Request) -> None:
        """Release a request's blocks (tail first, so shared prefixes are evicted last)."""
        blocks = self._blocks.pop(request.request_id, [])
        self._block_hashes.pop(request.request_id, None)
        self.block_pool.free(list(reversed(blocks)))

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        hashes = self._block_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            parent_hash = hashes[-1] if hashes else ROOT_HASH
            token_ids = request.all_token_ids[i * bs : (i + 1) * bs]
            hashes.append(self.block_pool.cache(blocks[i], parent_hash, token_ids))
