"""Suffix drafting (SuffixDecoding, vLLM's `method: "suffix"`): drafts from the longest match of
a request's recent tokens in its own text and in earlier completions of the same prompt.

RL samples a group of completions per prompt and sees the same prompts again every epoch, so
a rollout repeats text the engine already generated. Each prompt (keyed by its token ids) keeps
a history of its finished completions, each stored after the prompt's last tokens so that the
start of a completion can be drafted too; histories are bounded in tokens, engine-wide, the
oldest completion dropped first. They hold tokens, not weights: they stay valid across weight
updates and LoRA adapter versions (drafts are verified exactly, so a stale one costs a
rejection, never a wrong token) and are dropped only when asked (`reset`).

A proposal looks for the longest suffix of the request's tokens (up to `max_tree_depth`) that
occurs in each source (the request's own prompt and output, the prompt's history): every
occurrence of that suffix is a path in a suffix tree of the source, and the draft follows the
tree by counts: at each depth the most frequent next token among the occurrences still agreeing,
while the path's probability (the product of each choice's share) stays at or above
`min_token_prob`; a draft is at most `max_spec_factor` times the match long. Of the two
sources' drafts the one with more expected accepted tokens (the sum of its path
probabilities) is proposed; a match of one token drafts nothing. The search is vectorised
(numpy): a history keeps its tokens' occurrences sorted, so those of the request's last token are
found by bisection; a match is then extended 8 tokens back per step over the surviving
occurrences, and where the occurrences agree on what follows (the common case) the draft is
read off at once.

`expected_remaining(request)`: the mean completion length of the prompt's history minus what
the request has generated, for a drafting budget that favours the longest rollouts;
`acceptance(request)`: the share of its prompt's drafts accepted so far (all its requests').
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from rollout_engine.config import SpeculativeConfig
from rollout_engine.core.request import Request

_SEPARATOR = -1
"""Between completions in a history: no token equals it, so no match crosses it."""
_MIN_MATCH = 2
"""A one-token match drafts noise as often as not (n-gram's `prompt_lookup_min` too)."""
_CHUNK = 8
"""Tokens a match is extended by per vectorised step."""
_MAX_PROMPT_STATS = 1 << 16
"""Prompts whose acceptance counters are kept (the least recently drafted go first)."""
MIN_DRAFTS_TO_JUDGE = 16
"""A prompt's acceptance rate is known once this many of its drafts were verified."""


class _Corpus:
    """Tokens to search, with where each token occurs (sorted once, so that the occurrences
    of a request's last token are found in O(log n) rather than by a pass over them all)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens
        # Positions that a token follows (the last position and those before a separator
        # cannot end an occurrence), sorted by token, then position.
        ends = np.flatnonzero(tokens[1:] != _SEPARATOR)
        order = np.argsort(tokens[ends], kind="stable")
        self._ends = ends[order]
        self._keys = tokens[self._ends]

    def ends_of(self, token: int) -> np.ndarray:
        lo, hi = np.searchsorted(self._keys, [token, token + 1])
        return self._ends[lo:hi]


@dataclass
class _PromptHistory:
    segments: deque[np.ndarray] = field(default_factory=deque)
    """Each completion after the prompt's last tokens, oldest first."""
    completion_lengths: deque[int] = field(default_factory=deque)
    num_completion_tokens: int = 0
    _corpus: _Corpus | None = None

    @property
    def mean_completion_length(self) -> float:
        return self.num_completion_tokens / len(self.completion_lengths)

    @property
    def corpus(self) -> _Corpus:
        """The segments joined by separators (rebuilt after a change)."""
        if self._corpus is None:
            parts = []
            for segment in self.segments:
                parts += [segment, np.array([_SEPARATOR], dtype=np.int64)]
            self._corpus = _Corpus(np.concatenate(parts) if parts
                                   else np.empty(0, dtype=np.int64))
        return self._corpus

    def append(self, segment: np.ndarray, completion_length: int) -> None:
        self.segments.append(segment)
        self.completion_lengths.append(completion_length)
        self.num_completion_tokens += completion_length
        self._corpus = None

    def pop_oldest(self) -> tuple[int, int]:
        """Drop the oldest completion; its tokens stored, and its length."""
        completion_length = self.completion_lengths.popleft()
        self.num_completion_tokens -= completion_length
        self._corpus = None
        return len(self.segments.popleft()), completion_length


@dataclass(frozen=True)
class _Draft:
    token_ids: list[int]
    score: float
    """Expected accepted tokens: the sum of the path's probabilities."""
    match_len: int


class SuffixProposer:
    """Suffix drafting over each request's own tokens and its prompt's earlier completions."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.max_cached_tokens = config.suffix_decoding_max_cached_tokens
        self._histories: dict[int, _PromptHistory] = {}
        self._order: deque[int] = deque()
        """The prompt key of every stored completion, oldest first (eviction order)."""
        self.num_cached_tokens = 0
        self._num_completions = self._num_completion_tokens = 0
        """Over every history: the mean completion length of a prompt not seen yet."""
        self._keys: dict[str, int] = {}
        """Prompt key by request id (computed once per request, dropped when it ends)."""
        self._acceptance: OrderedDict[int, list[int]] = OrderedDict()
        """Per prompt key: [draft tokens verified, accepted], every request of it together."""

    # ------------------------------------------------------------------------ proposing
    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        """Drafts for one request (at most `max_num_tokens`); [] when nothing matches."""
        max_num_tokens = min(max_num_tokens, self.num_speculative_tokens)
        if max_num_tokens <= 0:
            return []
        tokens = np.fromiter(request.all_token_ids, dtype=np.int64,
                             count=len(request.all_token_ids))
        query = tokens[-self.max_depth:]
        best = self._draft(tokens, query, _own_ends(tokens), max_num_tokens)
        history = self._histories.get(self._key(request))
        if history is not None:
            corpus = history.corpus
            other = self._draft(corpus.tokens, query, corpus.ends_of(int(query[-1])),
                                max_num_tokens)
            if best is None or (other is not None and (other.score, other.match_len)
                                > (best.score, best.match_len)):
                best = other
        return [] if best is None else best.token_ids

    def expected_remaining(self, request: Request) -> float | None:
        """Mean completion length of the request's prompt minus its output; of every prompt
        for a prompt with no finished completion yet (None: none has finished at all)."""
        history = self._histories.get(self._key(request))
        if history is not None:
            mean = history.mean_completion_length
        elif self._num_completions:
            mean = self._num_completion_tokens / self._num_completions
        else:
            return None
        return max(0.0, mean - request.num_output_tokens)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A request's drafts were verified: count them for its prompt."""
        key = self._keys.get(request_id)
        if key is None:
            return
        counts = self._acceptance.setdefault(key, [0, 0])
        self._acceptance.move_to_end(key)
        counts[0] += num_drafts
        counts[1] += num_accepted
        if len(self._acceptance) > _MAX_PROMPT_STATS:
            self._acceptance.popitem(last=False)

    def acceptance(self, request: Request) -> float | None:
        """The share of the request's prompt's drafts accepted (None: too few verified)."""
        counts = self._acceptance.get(self._key(request))
        if counts is None or counts[0] < MIN_DRAFTS_TO_JUDGE:
            return None
        return counts[1] / counts[0]

    def _draft(self, corpus: np.ndarray, query: np.ndarray, ends: np.ndarray,
               max_num_tokens: int) -> _Draft | None:
        match_len, ends = _longest_suffix_occurrences(corpus, query, ends)
        if match_len < _MIN_MATCH:
            return None
        limit = min(max_num_tokens, max(1, int(self.max_spec_factor * match_len)))
        token_ids, score = _follow_by_counts(corpus, ends, limit, self.min_token_prob)
        return _Draft(token_ids, score, match_len) if token_ids else None

    # ------------------------------------------------------------------------ history
    def add_completion(self, request: Request) -> None:
        """Remember a finished request's completion under its prompt."""
        key = self._keys.pop(request.request_id, None)
        if key is None:
            key = _prompt_key(request)
        output = request.output_token_ids
        if not output or self.max_cached_tokens <= 0:
            return
        prompt_tail = request.prompt_token_ids[-self.max_depth:]
        segment = np.fromiter([*prompt_tail, *output], dtype=np.int64,
                              count=len(prompt_tail) + len(output))
        self._histories.setdefault(key, _PromptHistory()).append(segment, len(output))
        self._order.append(key)
        self.num_cached_tokens += len(segment)
        self._num_completions += 1
        self._num_completion_tokens += len(output)
        while self.num_cached_tokens > self.max_cached_tokens and self._order:
            oldest = self._order.popleft()
            history = self._histories[oldest]
            num_tokens, completion_length = history.pop_oldest()
            self.num_cached_tokens -= num_tokens
            self._num_completions -= 1
            self._num_completion_tokens -= completion_length
            if not history.segments:
                del self._histories[oldest]

    def forget_request(self, request_id: str) -> None:
        """A request ended without a completion worth keeping (aborted)."""
        self._keys.pop(request_id, None)

    def reset(self) -> None:
        """Drop every prompt's history."""
        self._histories.clear()
        self._order.clear()
        self._acceptance.clear()
        self.num_cached_tokens = self._num_completions = self._num_completion_tokens = 0

    @property
    def num_prompts(self) -> int:
        return len(self._histories)

    def _key(self, request: Request) -> int:
        key = self._keys.get(request.request_id)
        if key is None:
            key = self._keys[request.request_id] = _prompt_key(request)
        return key


def _prompt_key(request: Request) -> int:
    """The prompt's tokens alone: completions under earlier weights or adapter versions are
    the best predictors of the next policy's (RL changes a policy a little per step)."""
    return hash(tuple(request.prompt_token_ids))


def _own_ends(tokens: np.ndarray) -> np.ndarray:
    """Where the last token occurred earlier in a request's own tokens (a token follows)."""
    return np.flatnonzero(tokens[: tokens.shape[0] - 1] == tokens[-1])


def _longest_suffix_occurrences(corpus: np.ndarray, query: np.ndarray, ends: np.ndarray
                                ) -> tuple[int, np.ndarray]:
    """The longest suffix of `query` found in `corpus` with a token after it, given `ends`,
    where its last token occurs so: the suffix's length and the end of each occurrence (0 and
    none if `ends` is empty). Extended `_CHUNK` tokens back per vectorised step."""
    if not ends.size:
        return 0, ends
    match_len, depth = 1, query.shape[0]
    while match_len < depth:
        offsets = match_len + np.arange(min(_CHUNK, depth - match_len))
        back = ends[:, None] - offsets[None, :]  # [occurrences, chunk]
        window = np.where(back >= 0, corpus[np.maximum(back, 0)], _SEPARATOR)
        agree = window == query[-1 - offsets][None, :]
        run = np.where(agree.all(axis=1), offsets.shape[0], agree.argmin(axis=1))
        longest = int(run.max())
        if longest == 0:
            break
        ends, match_len = ends[run == longest], match_len + longest
        if longest < offsets.shape[0]:
            break
    return match_len, ends


def _follow_by_counts(corpus: np.ndarray, ends: np.ndarray, limit: int, min_prob: float
                      ) -> tuple[list[int], float]:
    """Walk the suffix tree from the occurrences `ends`: at each depth the most frequent next
    token of the occurrences still on the path, while the path's probability stays at or above
    `min_prob`. The tokens and the sum of their path probabilities."""
    n = corpus.shape[0]
    positions = ends[:, None] + np.arange(1, limit + 1)[None, :]
    paths = np.where(positions < n, corpus[np.minimum(positions, n - 1)], _SEPARATOR)
    # Where every occurrence goes on the same way, each token's share is 1: take the lead at
    # once (the common case: the samples of a prompt agree most of the time).
    agree = (paths == paths[0]).all(axis=0) & (paths[0] != _SEPARATOR)
    lead = limit if agree.all() else int(agree.argmin())
    token_ids: list[int] = paths[0, :lead].tolist()
    prob, score = 1.0, float(lead)
    rows = np.arange(paths.shape[0])
    for depth in range(lead, limit):
        column = paths[rows, depth]
        continuing = column[column != _SEPARATOR]
        if not continuing.size:
            break
        values, counts = np.unique(continuing, return_counts=True)
        best = int(counts.argmax())
        share = counts[best] / rows.size
        if prob * share < min_prob:
            break
        prob *= share
        score += prob
        token_ids.append(int(values[best]))
        rows = rows[column == values[best]]
    return token_ids, score
