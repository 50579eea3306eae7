"""The token ids each generated token could have been sampled from (vLLM's sampling mask)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingMask:
    """Per generated token, the ids that survived the sampler's truncation (top-k, top-p,
    min-p, and the masks of `allowed_token_ids`, bad words and grammars), in increasing id
    order: `counts[i]` ids for token i, all of them back to back in `flat_token_ids` (int32
    little-endian bytes), in process and over gRPC alike; `token_ids` gives them as vLLM's
    list of lists. A greedy token's support is the token alone."""

    counts: list[int]
    flat_token_ids: bytes

    @property
    def token_ids(self) -> list[list[int]]:
        """vLLM's form: `token_ids[i]`, the ids generated token i could have been."""
        return self.to_lists()

    @classmethod
    def of(cls, id_lists: Iterable[Sequence[int] | np.ndarray]) -> SamplingMask:
        """From one list (or int array) of ids per token."""
        arrays = [np.asarray(ids, dtype="<i4").reshape(-1) for ids in id_lists]
        flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype="<i4")
        return cls([len(a) for a in arrays], flat.tobytes())

    @classmethod
    def concat(cls, masks: Iterable[SamplingMask | None]) -> SamplingMask:
        """The masks of consecutive tokens as one (a stream's deltas; None adds nothing)."""
        masks = [m for m in masks if m is not None]
        return cls([c for m in masks for c in m.counts], b"".join(m.flat_token_ids for m in masks))

    def __len__(self) -> int:
        """The number of tokens it covers."""
        return len(self.counts)

    def to_numpy(self) -> np.ndarray:
        """Every token's ids back to back, [sum(counts)] int32; token i's are
        `np.split(ids, np.cumsum(counts)[:-1])[i]`."""
        return np.frombuffer(self.flat_token_ids, dtype="<i4")

    def to_lists(self) -> list[list[int]]:
        """One list of ids per token."""
        ids = self.to_numpy().tolist()
        offsets = [0, *np.cumsum(self.counts, dtype=np.int64).tolist()]
        return [ids[begin:end] for begin, end in itertools.pairwise(offsets)]
