"""Finished turns whose KV is kept warm for the conversation's next turn. No torch.

A multi-turn rollout sends turn k+1 as turn k's tokens plus the tool's answer: every full
block of turn k is a prefix-cache hit, if those blocks are still there. Freed blocks sit in
the pool's LRU queue, and under load new requests evict them within seconds, typically while
the tool is still running. A hold keeps a finished request's cached blocks referenced (not in
the free queue) so that LRU eviction passes them by, until the first of:

- the next turn hits them (its own references take over; the hold has done its job);
- its deadline passes (the client said how long the next turn may take, capped by the engine);
- the pool runs out: a request that needs blocks takes them from the holds, oldest first,
  before it would be preempted or left waiting. A hold changes the order of eviction, never
  how many blocks other requests can have, so it cannot starve them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

from rollout_engine.core.block_pool import BlockPool, KVBlock


@dataclass(frozen=True)
class _Hold:
    blocks: tuple[KVBlock, ...]
    """The finished request's cached blocks, in order (one reference each)."""
    deadline_s: float


class KVHolds:
    """The holds of one block pool, oldest first."""

    def __init__(self, block_pool: BlockPool) -> None:
        self._pool = block_pool
        self._holds: OrderedDict[str, _Hold] = OrderedDict()
        self._refs: Counter[int] = Counter()
        """Block id -> how many holds reference it."""
        self._by_tail: dict[int, str] = {}
        """The last block of each hold -> its key. A block's chained hash names its whole
        prefix, so two holds with the same tail hold the same blocks."""

    def __len__(self) -> int:
        return len(self._holds)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held."""
        return len(self._refs)

    def block_refs(self) -> dict[int, int]:
        """Block id -> how many holds reference it."""
        return dict(self._refs)

    def hold(self, key: str, blocks: list[KVBlock], deadline_s: float) -> None:
        """Keep `blocks` (whose references the caller hands over) until `deadline_s`."""
        if not blocks:
            return
        previous = self._by_tail.get(blocks[-1].block_id)
        if previous is not None:
            self.release(previous)  # the same prefix, held again: keep the newer deadline
        self._holds[key] = _Hold(tuple(blocks), deadline_s)
        self._refs.update(b.block_id for b in blocks)
        self._by_tail[blocks[-1].block_id] = key

    def release(self, key: str) -> None:
        hold = self._holds.pop(key)
        del self._by_tail[hold.blocks[-1].block_id]
        self._refs.subtract(b.block_id for b in hold.blocks)
        self._refs = +self._refs  # drop zero counts
        self._pool.free(list(reversed(hold.blocks)))

    def release_all(self) -> None:
        for key in list(self._holds):
            self.release(key)

    def release_expired(self, now_s: float) -> None:
        for key in [k for k, h in self._holds.items() if h.deadline_s <= now_s]:
            self.release(key)

    def release_hit(self, hit_blocks: Collection[KVBlock]) -> None:
        """A new request took references to `hit_blocks`: holds it now covers are done."""
        for block in hit_blocks:
            key = self._by_tail.get(block.block_id)
            if key is not None:
                self.release(key)

    def num_reclaimable(self, excluding: Collection[KVBlock] = ()) -> int:
        """Blocks that releasing every hold would return to the free queue (only holds
        reference them), not counting `excluding`."""
        excluded = {b.block_id for b in excluding}
        return sum(
            1 for block_id, refs in self._refs.items()
            if block_id not in excluded and self._pool.blocks[block_id].ref_count == refs
        )

    def release_oldest(self) -> None:
        self.release(next(iter(self._holds)))
