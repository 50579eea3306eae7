"""N-gram (prompt lookup) draft proposer: drafts come from an earlier repeat of the suffix."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rollout_engine.config import SpeculativeConfig


class NgramProposer:
    """Proposes draft tokens by matching the sequence's suffix against its own history.

    For one sequence (prompt + committed output) it finds the longest suffix, between
    `prompt_lookup_min` and `prompt_lookup_max` tokens long, that also occurs earlier,
    and drafts the up-to `num_speculative_tokens` tokens that followed that occurrence.

    Tie-breaking: among the occurrences of the longest matching suffix, the most recent
    one (the one ending closest to the end) is used, as long as at least one token
    follows it. Recent context is the better predictor of what comes next; the price is
    that a very recent occurrence may have fewer tokens after it than `k` (vLLM instead
    takes the earliest occurrence). Occurrences may overlap the suffix itself.

    The search is vectorised: every earlier position whose token equals the last token is
    a candidate, and candidates are filtered one token further back per step, so a step
    costs one numpy comparison over the survivors and the loop ends as soon as none are
    left. Cost is O(len * prompt_lookup_max) in the worst case (tiny alphabets) and close
    to O(len) for real vocabularies.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.prompt_lookup_min = config.prompt_lookup_min
        self.prompt_lookup_max = config.prompt_lookup_max

    def propose(
        self, token_ids: Sequence[int] | np.ndarray, max_num_tokens: int | None = None
    ) -> list[int]:
        """Drafts for one sequence; `max_num_tokens` optionally caps their number.

        Returns [] when no suffix of an allowed length occurred earlier.
        """
        num_drafts = self.num_speculative_tokens
        if max_num_tokens is not None:
            num_drafts = min(num_drafts, max_num_tokens)
        if num_drafts <= 0:
            return []
        tokens = _as_token_array(token_ids)
        end = _find_match_end(tokens, self.prompt_lookup_min, self.prompt_lookup_max)
        if end < 0:
            return []
        return tokens[end + 1 : end + 1 + num_drafts].tolist()

    def propose_batch(
        self,
        batch: list[Sequence[int]] | list[np.ndarray],
        max_num_tokens: list[int] | None = None,
    ) -> list[list[int]]:
        """Drafts for each sequence of `batch`; `max_num_tokens[i]` caps row `i`.

        The cap is the room a row has left (before `max_tokens` or the model length).
        """
        if max_num_tokens is None:
            return [self.propose(token_ids) for token_ids in batch]
        if len(max_num_tokens) != len(batch):
            raise ValueError(
                f"max_num_tokens has {len(max_num_tokens)} entries but the batch has "
                f"{len(batch)} sequences; pass one cap per sequence or None"
            )
        return [self.propose(ids, cap) for ids, cap in zip(batch, max_num_tokens)]


def _as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """A 1-D integer array of `token_ids`; arrays are used as they are, without a copy."""
    if not isinstance(token_ids, np.ndarray):
        # fromiter is about twice as fast as np.asarray on a list of Python ints.
        return np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
    if token_ids.ndim != 1 or not np.issubdtype(token_ids.dtype, np.integer):
        raise ValueError(
            f"token_ids must be a flat array of ints, got shape {token_ids.shape} "
            f"and dtype {token_ids.dtype}"
        )
    return token_ids


def _find_match_end(tokens: np.ndarray, min_n: int, max_n: int) -> int:
    """End index of the most recent earlier occurrence of the longest matching suffix.

    Only occurrences ending before the last position count (a token must follow them).
    Returns -1 when the longest match is shorter than `min_n`.
    """
    num_tokens = tokens.shape[0]
    if num_tokens < min_n + 1:
        return -1
    # Candidate ends j in [0, num_tokens - 2] whose token equals the last one: the
    # suffix of length 1 matches the window ending at j.
    ends = np.flatnonzero(tokens[: num_tokens - 1] == tokens[num_tokens - 1])
    best_end, match_len = -1, 0
    while ends.size > 0:
        match_len += 1
        best_end = int(ends[-1])  # `ends` is ascending: the last one is the most recent
        if match_len == max_n:
            break
        # Extend the match one token back: keep ends whose window has room and agrees.
        ends = ends[ends >= match_len]
        ends = ends[tokens[ends - match_len] == tokens[num_tokens - 1 - match_len]]
    return best_end if match_len >= min_n else -1
