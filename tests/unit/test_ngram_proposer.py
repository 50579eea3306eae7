"""Tests for the n-gram (prompt lookup) draft proposer against a brute-force reference."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from rollout_engine.config import SpeculativeConfig
from rollout_engine.core.ngram_proposer import NgramProposer


def make_proposer(k: int = 3, min_n: int = 2, max_n: int = 5) -> NgramProposer:
    config = SpeculativeConfig(
        num_speculative_tokens=k, prompt_lookup_min=min_n, prompt_lookup_max=max_n
    )
    return NgramProposer(config)


def reference_propose(
    token_ids: list[int], k: int, min_n: int, max_n: int, cap: int | None = None
) -> list[int]:
    """Longest suffix first, then the most recent earlier start with a token after it."""
    num_drafts = k if cap is None else min(k, cap)
    if num_drafts <= 0:
        return []
    num_tokens = len(token_ids)
    for n in range(max_n, min_n - 1, -1):
        suffix = token_ids[num_tokens - n :] if n <= num_tokens else None
        # An occurrence starting at `start` ends at start + n - 1 <= num_tokens - 2.
        for start in range(num_tokens - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + num_drafts]
    return []


def random_sequence(rng: random.Random, max_len: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(rng.randrange(max_len + 1))]


CONFIGS = [  # (k, min_n, max_n)
    (3, 2, 5),
    (1, 1, 1),
    (5, 1, 3),
    (4, 3, 3),
    (8, 2, 8),
    (2, 4, 6),
]


@pytest.mark.parametrize(("k", "min_n", "max_n"), CONFIGS)
def test_matches_reference_on_random_sequences(k: int, min_n: int, max_n: int) -> None:
    proposer = make_proposer(k, min_n, max_n)
    rng = random.Random(1000 * k + 10 * min_n + max_n)
    num_nonempty = 0
    for trial in range(1500):
        vocab_size = (2, 3, 5, 20)[trial % 4]
        token_ids = random_sequence(rng, 40, vocab_size)
        expected = reference_propose(token_ids, k, min_n, max_n)
        assert proposer.propose(token_ids) == expected, (token_ids, expected)
        num_nonempty += bool(expected)
    assert num_nonempty > 150  # small alphabets: many sequences do match


@pytest.mark.parametrize(("k", "min_n", "max_n"), CONFIGS[:3])
def test_batch_with_caps_matches_reference(k: int, min_n: int, max_n: int) -> None:
    proposer = make_proposer(k, min_n, max_n)
    rng = random.Random(7 + k)
    for _ in range(50):
        batch = [random_sequence(rng, 60, 3) for _ in range(16)]
        caps = [rng.randrange(-1, k + 2) for _ in batch]
        expected = [reference_propose(ids, k, min_n, max_n, cap) for ids, cap in zip(batch, caps)]
        assert proposer.propose_batch(batch, caps) == expected
        expected = [reference_propose(ids, k, min_n, max_n) for ids in batch]
        assert proposer.propose_batch(batch) == expected


def test_numpy_and_tuple_inputs_agree_with_lists() -> None:
    proposer = make_proposer(4, 1, 4)
    rng = random.Random(3)
    for _ in range(200):
        token_ids = random_sequence(rng, 50, 4)
        expected = proposer.propose(token_ids)
        assert proposer.propose(tuple(token_ids)) == expected
        for dtype in (np.int32, np.int64, np.uint32):
            drafts = proposer.propose(np.array(token_ids, dtype=dtype))
            assert drafts == expected
            assert all(type(token) is int for token in drafts)


def test_longest_suffix_wins_over_more_recent_shorter_one() -> None:
    # Suffix [1, 2, 3] occurs at the start; only [2, 3] occurs more recently.
    token_ids = [1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 1, 2, 3]
    assert make_proposer(2, 2, 3).propose(token_ids) == [10, 11]
    assert make_proposer(2, 2, 2).propose(token_ids) == [20, 21]


def test_most_recent_occurrence_wins_among_equal_lengths() -> None:
    token_ids = [7, 8, 1, 7, 8, 2, 7, 8, 3, 7, 8]
    assert make_proposer(2, 2, 2).propose(token_ids) == [3, 7]


def test_match_at_the_very_start() -> None:
    token_ids = [4, 5, 6, 7, 8, 9, 4, 5]
    assert make_proposer(3, 2, 4).propose(token_ids) == [6, 7, 8]


def test_no_match_returns_empty() -> None:
    proposer = make_proposer(3, 2, 5)
    assert proposer.propose([1, 2, 3, 4, 5, 6]) == []
    # Only the last token repeats: shorter than prompt_lookup_min.
    assert proposer.propose([1, 2, 9, 3, 2]) == []


@pytest.mark.parametrize("token_ids", [[], [5], [5, 5], [1, 2]])
def test_short_sequences(token_ids: list[int]) -> None:
    proposer = make_proposer(3, 2, 5)
    assert proposer.propose(token_ids) == []
    assert proposer.propose(np.array(token_ids, dtype=np.int64)) == []


def test_shortest_sequence_that_can_match() -> None:
    assert make_proposer(3, 1, 3).propose([5, 5]) == [5]
    assert make_proposer(3, 2, 3).propose([5, 5, 5]) == [5]


def test_k_larger_than_available_continuation() -> None:
    # The match ends two tokens before the end: only two tokens follow it.
    token_ids = [1, 2, 3, 4, 9, 9, 9, 9, 3, 4, 5, 3, 4]
    assert make_proposer(10, 2, 2).propose(token_ids) == [5, 3, 4]
    assert make_proposer(10, 2, 2).propose([3, 4, 3, 4]) == [3, 4]


def test_min_equals_max_ignores_other_lengths() -> None:
    token_ids = [1, 2, 3, 50, 9, 2, 3, 60, 1, 2, 3]
    assert make_proposer(1, 3, 3).propose(token_ids) == [50]
    assert make_proposer(1, 2, 2).propose(token_ids) == [60]
    assert make_proposer(1, 4, 4).propose(token_ids) == []


def test_repeated_token_sequence_overlapping_occurrence() -> None:
    # The most recent occurrence of the suffix overlaps it and is followed by one token.
    assert make_proposer(4, 2, 5).propose([7] * 20) == [7]
    # Period 3: the most recent occurrence is three tokens back.
    assert make_proposer(5, 2, 5).propose([1, 2, 3] * 6) == [1, 2, 3]


def test_max_num_tokens_caps() -> None:
    proposer = make_proposer(4, 2, 3)
    token_ids = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert proposer.propose(token_ids) == [3, 4, 5, 6]
    assert proposer.propose_batch([token_ids] * 4, [0, 2, 4, 9]) == [
        [],
        [3, 4],
        [3, 4, 5, 6],
        [3, 4, 5, 6],
    ]
    assert proposer.propose(token_ids, max_num_tokens=-3) == []


def test_disabled_config_proposes_nothing() -> None:
    assert make_proposer(0, 1, 3).propose([1, 1, 1, 1]) == []


def test_batch_cap_length_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="one cap per sequence"):
        make_proposer().propose_batch([[1, 2], [3, 4]], [1])


def test_non_flat_or_non_integer_array_is_rejected() -> None:
    proposer = make_proposer()
    with pytest.raises(ValueError, match="flat array of ints"):
        proposer.propose(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="flat array of ints"):
        proposer.propose(np.array([1.0, 2.0, 1.0]))


@pytest.mark.slow
def test_benchmark_batch_of_64_sequences_of_1000_tokens() -> None:
    proposer = make_proposer(4, 2, 5)
    rng = np.random.default_rng(0)
    phrase = rng.integers(0, 32000, size=40)
    workloads = {
        "vocab 32000, random": rng.integers(0, 32000, size=(64, 1000)),
        "vocab 4, random (worst case)": rng.integers(0, 4, size=(64, 1000)),
        "vocab 32000, repeated phrases": np.stack(
            [np.resize(np.concatenate([phrase, rng.integers(0, 32000, 60)]), 1000)] * 64
        ),
    }
    for name, rows in workloads.items():
        for as_lists in (False, True):
            batch = [row.tolist() for row in rows] if as_lists else list(rows)
            proposer.propose_batch(batch)  # warm-up
            num_repeats = 20
            start_s = time.perf_counter()
            for _ in range(num_repeats):
                proposer.propose_batch(batch)
            elapsed_s = (time.perf_counter() - start_s) / num_repeats
            kind = "lists" if as_lists else "arrays"
            print(
                f"\n{name} ({kind}): {elapsed_s * 1e3:.2f} ms per batch of 64, "
                f"{elapsed_s / 64 * 1e6:.1f} us per sequence"
            )
