"""The suffix proposer on hand-built requests: drafts from the request's own text and from
earlier completions of its prompt, chosen by counts and cut by probability and match length;
histories keyed by prompt, bounded in tokens, dropped on reset."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_engine import SamplingParams
from rollout_engine.config import SpeculativeConfig
from rollout_engine.core.request import Request
from rollout_engine.core.suffix_proposer import (
    SuffixProposer,
    _Corpus,
    _follow_by_counts,
    _longest_suffix_occurrences,
)


def make_request(request_id: str, prompt: list[int], output: list[int] = (), lora_id: int = 0
                 ) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=100), lora_id=lora_id)
    for token in output:
        request.append_output_token(token, None)
    return request


def proposer(k: int = 4, **options) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig(method="suffix", num_speculative_tokens=k, **options))


def longest(tokens: list[int], query: list[int]) -> tuple[int, list[int]]:
    corpus = _Corpus(np.array(tokens))
    match_len, ends = _longest_suffix_occurrences(corpus.tokens, np.array(query),
                                                  corpus.ends_of(query[-1]))
    return match_len, ends.tolist()


def test_longest_suffix_and_its_occurrences():
    corpus = [7, 1, 2, 3, 9, 1, 2, 3, 5, 2, 3, -1, 2, 3]
    assert longest(corpus, [4, 1, 2, 3]) == (3, [3, 7])  # "1 2 3", each followed by a token
    # "2 3" also ends at 10, but the separator follows it; at 13 nothing does.
    assert longest(corpus, [8, 8]) == (0, [])
    # Matches longer than the step by which they are extended, of different lengths: the
    # longest wins; the query's depth caps it.
    text = list(range(100, 130))
    corpus = [*text, 1, -1, 5, *text[7:], 2, -1, *text[20:], 3]
    assert longest(corpus, [0, *text]) == (30, [29])
    assert longest(corpus, text[3:]) == (27, [29])
    assert longest(corpus, [9, *text[20:]]) == (10, [29, 55, 67])


def test_the_path_follows_the_most_frequent_token_while_it_is_likely():
    # After "1": 2 three times (then 3, 3, 4), 5 once.
    corpus = np.array([1, 2, 3, -1, 1, 2, 3, -1, 1, 2, 4, -1, 1, 5])
    ends = np.array([0, 4, 8, 12])
    assert _follow_by_counts(corpus, ends, 5, 0.1) == ([2, 3], pytest.approx(0.75 + 0.5))
    assert _follow_by_counts(corpus, ends, 5, 0.6)[0] == [2]  # 3 has a path probability of 0.5
    assert _follow_by_counts(corpus, ends, 1, 0.1)[0] == [2]


def test_drafts_from_its_own_text():
    p = proposer(k=8)
    request = make_request("a", [5, 6, 7, 8, 9, 5, 6, 7])
    # "5 6 7" matched: at most 3 drafts (max_spec_factor 1), what followed it.
    assert p.propose(request, 8) == [8, 9, 5]
    assert p.propose(request, 2) == [8, 9]


def test_a_new_sample_drafts_an_earlier_completion_of_its_prompt_from_its_first_token():
    p = proposer(k=4)
    prompt = [11, 12, 13, 14, 15]
    assert p.propose(make_request("first", prompt), 4) == []
    p.add_completion(make_request("first", prompt, [40, 41, 42, 43, 44]))
    assert p.propose(make_request("second", prompt), 4) == [40, 41, 42, 43]
    assert p.propose(make_request("third", prompt, [40, 41]), 4) == [42, 43, 44]
    # Another prompt has no history; the same one under another adapter (a new policy
    # version) shares it.
    assert p.propose(make_request("other", [1, 12, 13, 14, 15]), 4) == []
    assert p.propose(make_request("adapted", prompt, lora_id=3), 4) == [40, 41, 42, 43]
    assert p.expected_remaining(make_request("x", prompt, [40, 41])) == 3
    assert p.expected_remaining(make_request("y", [1, 2])) == 5  # the mean over every prompt
    assert proposer().expected_remaining(make_request("z", [1, 2])) is None  # no history


def test_the_better_source_wins():
    p = proposer(k=4, suffix_decoding_max_spec_factor=4.0)
    prompt = [3, 4, 5]
    # Its own text matches "20 21" once, with three tokens after it.
    request = make_request("new", prompt, [20, 21, 8, 20, 21])
    assert p.propose(request, 4) == [8, 20, 21]
    # Three earlier completions agree on four tokens after "20 21": more expected tokens.
    for i in range(3):
        p.add_completion(make_request(f"old{i}", prompt, [20, 21, 22, 23, 24, 25]))
    assert p.propose(request, 4) == [22, 23, 24, 25]
    # A one-token match drafts nothing.
    assert p.propose(make_request("short", [3, 9], [7, 3]), 4) == []


def test_histories_are_bounded_oldest_first_and_reset():
    p = proposer(k=2, suffix_decoding_max_cached_tokens=20, suffix_decoding_max_tree_depth=4)
    for i in range(4):  # segments of 4 prompt-tail tokens + 4 outputs
        p.add_completion(make_request(f"r{i}", [1, 2, 3, 4 + i], [50 + i] * 4))
    assert p.num_cached_tokens <= 20 and p.num_prompts == 2
    assert p.propose(make_request("new0", [1, 2, 3, 4]), 2) == []  # the oldest went first
    assert p.propose(make_request("new3", [1, 2, 3, 7]), 2) == [53, 53]
    p.reset()
    assert p.num_cached_tokens == 0 and p.propose(make_request("again", [1, 2, 3, 7]), 2) == []


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="min_token_prob"):
        SpeculativeConfig(method="suffix", num_speculative_tokens=2,
                          suffix_decoding_min_token_prob=1.5)


def test_the_budget_goes_to_sure_prompts_then_to_the_longest_expected():
    from rollout_engine.core.spec_decode import SpecDecoder

    config = SpeculativeConfig(method="suffix", num_speculative_tokens=2,
                               disable_by_batch_size=2)
    decoder = SpecDecoder(config, max_model_len=1000)
    history = {"sure": ([1, 2], [30, 31, 32] * 8), "long": ([3, 4], [40, 41, 42] * 8),
               "short": ([5, 6], [50, 51, 52])}
    for name, (prompt, completion) in history.items():
        decoder.suffix.add_completion(make_request(f"old-{name}", prompt, completion))
    running = {name: make_request(name, prompt, completion[:2])
               for name, (prompt, completion) in history.items()}
    decoder.suffix.propose(running["sure"], 2)  # its prompt key is known from here on
    decoder.suffix.record("sure", 20, 18)  # 90% of its prompt's drafts accepted
    # Four requests, a budget of two: the sure one, then the one expected to run longest.
    extra = make_request("extra", [7, 8], [60, 61])
    drafts = decoder.propose([running["short"], extra, running["long"], running["sure"]], 4)
    assert set(drafts) == {"sure", "long"}
    assert decoder.stats.num_budgeted_steps == 1


def test_a_request_whose_proposals_find_nothing_waits_longer_each_time():
    from rollout_engine.core.spec_decode import SpecDecoder

    decoder = SpecDecoder(SpeculativeConfig(method="suffix", num_speculative_tokens=2), 1000)
    request = make_request("r", [1, 2, 3], [4])
    proposed_at = []
    searched = decoder.suffix.propose
    decoder.suffix.propose = lambda r, k: proposed_at.append(step) or searched(r, k)
    for step in range(12):
        assert decoder.propose([request], 1) == {}
    assert proposed_at == [0, 2, 5, 9]  # waits of 1, 2, 3 steps
