"""Maps requests to KV blocks: allocation, prefix-cache hits and caching, freeing. No torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rollout_engine.core.block_pool import BlockPool, KVBlock, hash_block, root_hash
from rollout_engine.core.kv_holds import KVHolds
from rollout_engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class _PendingBlock:
    """A full block of committed tokens whose KV the step being scheduled writes."""

    block: KVBlock
    parent_hash: int
    token_ids: tuple[int, ...]


class KVCacheManager:
    """Owns each request's block table; hides the block pool behind a few verbs.

    Fault safety: a block enters the prefix cache only through `cache_blocks`, which the
    scheduler calls once the step that writes the block's KV has completed. Until then the
    block is "pending": requests scheduled in the *same* step may share it (the forward
    stores each layer's KV for the whole batch before any attention reads it), and if that
    step fails, all of them are ended together. `begin_step` forgets the pending blocks, so
    no later step can reach a block whose KV was never written.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        # The same tables as ids, grown in place (see get_block_ids).
        self._block_ids: dict[str, list[int]] = {}
        # Chained hashes of each request's full committed blocks known so far.
        self._block_hashes: dict[str, list[int]] = {}
        # How many of each request's leading blocks were handed to the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        self._pending: dict[int, _PendingBlock] = {}
        self.holds = KVHolds(self.block_pool)
        """Finished requests' cached blocks kept for their conversation's next turn."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can have: free ones, and those only a hold keeps."""
        return self.block_pool.num_free_blocks + self.holds.num_reclaimable()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: a live list, read-only for callers. It only grows
        while the request holds its blocks; once they are freed, a later allocation starts
        a new list, so a reader that keeps the list object can tell a table it has seen
        (same object: only appended to) from a new one."""
        return self._block_ids.get(request_id, [])

    def begin_step(self) -> None:
        """A new step is being scheduled: blocks pending in the last one are no longer shared."""
        self._pending.clear()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of full blocks matching the request's tokens: cached, or being written
        by the step now being scheduled. The last token is never served: its logits are needed
        (nor positions whose asked-for prompt logprobs need their logits; see
        `Request.max_prefix_hit_tokens`).
        """
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return [], 0
        bs = self.block_size
        max_hit_blocks = request.max_prefix_hit_tokens // bs
        parent_hash, hits = root_hash(request.lora_id), []
        for i in range(max_hit_blocks):
            token_ids = request.all_token_ids[i * bs : (i + 1) * bs]
            block = self.block_pool.lookup(parent_hash, token_ids)
            if block is None:
                block = self._lookup_pending(parent_hash, token_ids)
            if block is None:
                break
            hits.append(block)
            parent_hash = hash_block(parent_hash, token_ids)
        return hits, len(hits) * bs

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        delay_cache_blocks: bool = False,
    ) -> bool:
        """Make room for `num_new_tokens` more positions (drafts included).

        With `delay_cache_blocks` the new blocks are not offered to the step being scheduled
        either: their KV arrives from a remote engine, and they enter the prefix cache
        (`cache_blocks`) only once it has. Returns False, changing nothing, when the pool has
        too few free blocks.
        """
        blocks = self._blocks.setdefault(request.request_id, [])
        block_ids = self._block_ids.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        num_needed = cdiv(num_total, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Cache hits sitting in the free queue stop being free once touched.
        if not self._make_room(num_needed, new_computed_blocks):
            if not blocks:
                del self._blocks[request.request_id], self._block_ids[request.request_id]
            return False
        self.block_pool.touch(new_computed_blocks)
        self.holds.release_hit(new_computed_blocks)
        new_blocks = list(new_computed_blocks)
        if num_needed > 0:
            # After the request's last block (a cache hit's, if this step brought any).
            last = new_blocks[-1] if new_blocks else (blocks[-1] if blocks else None)
            new_blocks += self.block_pool.allocate(
                num_needed, after=last.block_id if last is not None else None)
        blocks.extend(new_blocks)
        block_ids.extend(b.block_id for b in new_blocks)
        if self.enable_prefix_caching and not delay_cache_blocks:
            # Only committed tokens are hashed, never drafts.
            self._add_pending(request, min(num_total, request.num_tokens))
        return True

    def cache_blocks(self, request: Request, num_written_tokens: int) -> None:
        """Enter the request's full blocks below `num_written_tokens` into the prefix cache.

        Call only once the KV of those positions is written.
        """
        if not self.enable_prefix_caching or request.request_id not in self._blocks:
            return
        num_full_blocks = min(num_written_tokens, request.num_tokens) // self.block_size
        hashes = self._extend_hashes(request, num_full_blocks)
        blocks = self._blocks[request.request_id]
        bs = self.block_size
        for i in range(self._num_cached_blocks.get(request.request_id, 0), num_full_blocks):
            parent_hash = hashes[i - 1] if i else root_hash(request.lora_id)
            token_ids = request.all_token_ids[i * bs : (i + 1) * bs]
            self.block_pool.cache(blocks[i], parent_hash, token_ids)
        self._num_cached_blocks[request.request_id] = max(
            num_full_blocks, self._num_cached_blocks.get(request.request_id, 0)
        )

    def num_cached_tokens(self, request_id: str) -> int:
        """Leading positions of the request handed to the prefix cache."""
        return self._num_cached_blocks.get(request_id, 0) * self.block_size

    def free(self, request: Request, hold_until_s: float | None = None) -> None:
        """Release a request's blocks (tail first, so shared prefixes are evicted last).
        With `hold_until_s`, its cached blocks are held until then for the conversation's
        next turn (see KVHolds) and only the rest is freed."""
        blocks = self._blocks.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        self._block_hashes.pop(request.request_id, None)
        num_cached = self._num_cached_blocks.pop(request.request_id, 0)
        if hold_until_s is not None and num_cached:
            self.holds.hold(request.request_id, blocks[:num_cached], hold_until_s)
            blocks = blocks[num_cached:]
        self.block_pool.free(list(reversed(blocks)))

    def reset_prefix_cache(self) -> None:
        self._pending.clear()
        self.holds.release_all()  # held blocks are worth nothing without their hashes
        self.block_pool.reset_prefix_cache()

    # ------------------------------------------------------------------ internals
    def _make_room(self, num_needed: int, hit_blocks: Sequence[KVBlock]) -> bool:
        """True if `num_needed` blocks can be allocated after `hit_blocks` are touched,
        releasing holds, oldest first, if that is what it takes (and only then)."""
        def room() -> int:
            # Cache hits sitting in the free queue stop being free once touched.
            return self.block_pool.num_free_blocks - sum(1 for b in hit_blocks if b.ref_count == 0)

        if num_needed <= room():
            return True
        if num_needed > room() + self.holds.num_reclaimable(excluding=hit_blocks):
            return False
        while num_needed > room():
            self.holds.release_oldest()
        return True

    def _extend_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """The request's chained block hashes, computed up to `num_full_blocks`."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_full_blocks):
            parent_hash = hashes[-1] if hashes else root_hash(request.lora_id)
            hashes.append(hash_block(parent_hash, request.all_token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def _add_pending(self, request: Request, num_tokens: int) -> None:
        """Offer the full blocks the step being scheduled writes to requests of that step."""
        num_known = len(self._block_hashes.get(request.request_id, ()))
        hashes = self._extend_hashes(request, num_tokens // self.block_size)
        blocks, bs = self._blocks[request.request_id], self.block_size
        for i in range(num_known, len(hashes)):
            if hashes[i] in self._pending or blocks[i].block_hash is not None:
                continue
            parent_hash = hashes[i - 1] if i else root_hash(request.lora_id)
            token_ids = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            self._pending[hashes[i]] = _PendingBlock(blocks[i], parent_hash, token_ids)

    def _lookup_pending(self, parent_hash: int, token_ids: Sequence[int]) -> KVBlock | None:
        pending = self._pending.get(hash_block(parent_hash, token_ids))
        if pending is None or pending.parent_hash != parent_hash:
            return None
        return pending.block if pending.token_ids == tuple(token_ids) else None
