"""Tests of vLLM's sampling surface in the sampler: allowed ids, bad words, min_tokens, logit
bias, presence/frequency penalties and top-k logprobs, each against a plain float64 reference
written here, on random logits, with and without drafts."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from rollout_engine.core.scheduler_output import (
    NO_ALLOWED_TOKEN_ID,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from rollout_engine.protocol import SamplingParams, TopLogprobs
from rollout_engine.worker.persistent_batch import PersistentBatch, StepRequest
from rollout_engine.worker.sampling.logits_processing import LogitsProcessing
from rollout_engine.worker.sampling.sampler import (
    Sampler,
    SampleResult,
    SamplingRow,
    request_stream_seed,
)
from rollout_engine.worker.step_inputs import sampling_row
from tests.unit.test_sampler import chi_square, random_logits, reference_filter
from tests.unit.test_step_inputs import SyncCounter

EOS = 2
# The vocabulary of the distribution tests: small enough that `logprobs=20` returns the whole
# distribution at every position, so the sampler's own processed distribution can be read.
VOCAB = 20
# The sampler works in float32, the reference in float64: a logprob x agrees within
# 1e-6 * max(1, |x|). Absolute 1e-6 alone cannot hold below |x| = 8, where float32's spacing
# (|x| * 2**-23 = 1e-6 at 8, 2e-6 at 16) is coarser than that; 1e-6 relative is still ~8
# float32 ulps, so a wrong logit (a missed penalty, a shifted bias) fails by far.
TOLERANCE = 1e-6


def close(got: float, expected: float) -> bool:
    return abs(got - expected) <= TOLERANCE * max(1.0, abs(expected))


def make_row(
    *,
    seed: int | None = None,
    sample_index: int = 0,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    drafts: list[int] | None = None,
    bad_words: list[list[int]] | None = None,
    **params,
) -> SamplingRow:
    """A row whose committed output is `output` (history filled whatever the features)."""
    prompt, output = list(prompt or [0, 1]), list(output or [])
    return SamplingRow(
        params=SamplingParams(**params),
        stream_seed=None if seed is None else request_stream_seed(seed, sample_index),
        token_history=prompt + output,
        draft_token_ids=list(drafts or []),
        first_output_index=len(output),
        num_prompt_tokens=len(prompt),
        bad_words_token_ids=[list(w) for w in bad_words or []],
    )


def num_positions(rows: list[SamplingRow]) -> int:
    return sum(len(row.draft_token_ids) + 1 for row in rows)


# ---------------------------------------------------------------- the reference


def reference_logits(
    logits: torch.Tensor, row: SamplingRow, j: int, eos_token_ids: tuple[int, ...] = (EOS,)
) -> torch.Tensor | None:
    """Processed logits (float64) at position j of `row`, token by token; None when the masks
    leave no token."""
    params, vocab = row.params, logits.shape[0]
    prompt = row.token_history[: row.num_prompt_tokens]
    output = row.token_history[row.num_prompt_tokens :] + row.draft_token_ids[:j]
    x = [float(v) for v in logits.double()]
    masked = [False] * vocab
    if params.allowed_token_ids is not None:
        masked = [t not in params.allowed_token_ids for t in range(vocab)]
    for word in row.bad_words_token_ids:
        prefix = word[:-1]
        ends_with_prefix = len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix
        if ends_with_prefix and word[-1] < vocab:
            masked[word[-1]] = True
    if row.first_output_index + j < params.min_tokens:
        stop = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
        for t in stop:
            if t < vocab:
                masked[t] = True
    if all(masked):
        return None
    for t in range(vocab):
        if masked[t]:
            x[t] = -math.inf
    for t, bias in params.logit_bias.items():
        if t < vocab:
            x[t] += bias
    penalty = params.repetition_penalty
    if penalty != 1.0:
        for t in set(prompt + output):
            if t < vocab:
                x[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
    for t in range(vocab):
        count = output.count(t)
        x[t] -= params.frequency_penalty * count
        if count > 0:
            x[t] -= params.presence_penalty
    return torch.tensor(x, dtype=torch.float64)


def reference_logprobs(
    logits: torch.Tensor, row: SamplingRow, j: int, eos_token_ids: tuple[int, ...] = (EOS,)
) -> torch.Tensor | None:
    """The distribution position j samples from (float64 log-probs): processed logits, then
    for sampled rows temperature and filters."""
    x = reference_logits(logits, row, j, eos_token_ids)
    if x is None:
        return None
    params = row.params
    if not params.is_greedy:
        x = reference_filter(x / params.temperature, params.top_k, params.top_p, params.min_p)
    return x.log_softmax(-1)


def distribution_of(entry: TopLogprobs, vocab: int) -> torch.Tensor:
    """The whole distribution from a `logprobs=vocab` entry (its top-k lists every token)."""
    assert sorted(entry.token_ids[1:]) == list(range(vocab)), entry
    dist = torch.empty(vocab, dtype=torch.float64)
    for t, lp in zip(entry.token_ids[1:], entry.logprobs[1:]):
        dist[t] = lp
    return dist


def assert_close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert torch.equal(got.isinf(), expected.isinf()), f"{what}: masks differ\n{got}\n{expected}"
    finite = ~expected.isinf()
    error = (got[finite] - expected[finite]).abs() / expected[finite].abs().clamp(min=1.0)
    assert error.max().item() <= TOLERANCE, f"{what}: max relative error {error.max():.2e}"


def with_argmax_drafts(
    logits: torch.Tensor, row_kwargs: dict, num_drafts: int, bump: float = 0.0
) -> SamplingRow:
    """A row whose drafts are its reference's most likely tokens, each made more likely by
    `bump` in `logits` (edited in place), so that drafts are accepted and every position
    returns a token to check."""
    drafts: list[int] = []
    for j in range(num_drafts):
        probe = make_row(drafts=drafts, **row_kwargs)
        draft = int(reference_logprobs(logits[j], probe, j).argmax())
        logits[j, draft] += bump
        drafts.append(draft)
    return make_row(drafts=drafts, **row_kwargs)


# ---------------------------------------------------------------- processed distributions

FEATURES = {
    "allowed_token_ids": {"allowed_token_ids": [1, 4, 5, 9, 13, 17, 40]},
    "bad_words": {"bad_words": [[3], [6, 7], [7, 8], [11, 6, 9], [5, 5], [30]]},
    "min_tokens": {"min_tokens": 6, "stop_token_ids": [4, 9]},
    "min_tokens_ignore_eos": {"min_tokens": 6, "stop_token_ids": [4], "ignore_eos": True},
    "logit_bias": {"logit_bias": {0: 3.0, 5: -100.0, 12: 0.5, 25: 1.0}},
    "presence_penalty": {"presence_penalty": 1.5},
    "frequency_penalty": {"frequency_penalty": -0.7},
    "all": {"allowed_token_ids": list(range(2, 18)), "bad_words": [[6, 7], [8]],
            "min_tokens": 7, "logit_bias": {9: 2.0, 10: -1.5}, "presence_penalty": 0.4,
            "frequency_penalty": 0.6, "repetition_penalty": 1.3},
}
# Outputs ending in bad words' prefixes; each has output tokens repeated (penalties).
OUTPUTS = [[6, 5, 6], [11, 6, 7, 7, 5], [9, 9, 3, 11]]


def feature_batch(
    feature: dict, seed: int
) -> tuple[torch.Tensor, list[SamplingRow], list[bool]]:
    """Greedy and sampled rows with the feature (plain and drafting, several seeds for the
    drafting sampled rows) among greedy and sampled rows without it: logits, rows, and
    which rows use the feature."""
    specs = []  # (kwargs, num_drafts, bump, uses the feature)
    for i, output in enumerate(OUTPUTS):
        greedy = {"temperature": 0.0, "output": output, "logprobs": VOCAB}
        sampled = {"temperature": 0.8, "top_k": 12, "output": output, "logprobs": VOCAB}
        specs += [
            (greedy | feature, 0, 0.0, True),
            (greedy | feature, 3, 0.0, True),
            (greedy, 2, 0.0, False),
            (sampled | {"seed": 10 * seed + i} | feature, 0, 0.0, True),
            (sampled | {"top_p": 0.9, "seed": i} | feature, 0, 0.0, True),
            (sampled | {"seed": i}, 0, 0.0, False),
        ]
        specs += [(sampled | {"seed": 99, "sample_index": s} | feature, 2, 6.0, True)
                  for s in range(6)]
    logits, rows, uses = [], [], []
    for index, (kwargs, num_drafts, bump, used) in enumerate(specs):
        row_logits = random_logits(num_drafts + 1, VOCAB, scale=2.0, seed=1000 * seed + index)
        rows.append(with_argmax_drafts(row_logits, kwargs, num_drafts, bump))
        logits.append(row_logits)
        uses.append(used)
    return torch.cat(logits), rows, uses


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("feature", FEATURES.values(), ids=FEATURES.keys())
def test_processed_distribution_matches_the_reference(feature: dict, seed: int) -> None:
    logits, rows, uses = feature_batch(feature, seed)
    results = Sampler(eos_token_ids=(EOS,))(logits, rows)
    checked: Counter[tuple[bool, bool, int, int]] = Counter()  # (uses, greedy, drafts, j)
    offset = 0
    for i, (row, result, used) in enumerate(zip(rows, results, uses)):
        assert len(result.top_logprobs) == len(result.token_ids)
        for j, (token, logprob, entry) in enumerate(
            zip(result.token_ids, result.logprobs, result.top_logprobs)
        ):
            expected = reference_logprobs(logits[offset + j], row, j)
            assert expected is not None
            got = distribution_of(entry, VOCAB)
            assert_close(got, expected, f"row {i} position {j}")
            assert close(logprob, expected[token].item()) and not math.isinf(logprob)
            if row.params.is_greedy:
                assert token == int(expected.argmax()), f"row {i} position {j}"
            checked[used, row.params.is_greedy, len(row.draft_token_ids), j] += 1
        offset += len(row.draft_token_ids) + 1
    # Every position of the feature's drafting rows, greedy and sampled, was returned (and so
    # checked) somewhere, as were the rows without the feature.
    assert all(checked[True, True, 3, j] for j in range(4)), checked
    assert all(checked[True, False, 2, j] for j in range(3)), checked
    assert checked[False, True, 2, 2] and checked[False, False, 0, 0], checked


@pytest.mark.parametrize("feature", FEATURES.values(), ids=FEATURES.keys())
def test_rows_without_the_feature_are_unchanged(feature: dict) -> None:
    """The rows without the feature give the same results when the feature rows are
    replaced by plain greedy rows (of as many positions)."""
    logits, rows, uses = feature_batch(feature, seed=0)
    replaced = [make_row(temperature=0.0, drafts=row.draft_token_ids) if used else row
                for row, used in zip(rows, uses)]
    mixed = Sampler(seed=3, eos_token_ids=(EOS,))(logits, rows)
    without = Sampler(seed=3, eos_token_ids=(EOS,))(logits, replaced)
    assert [r for r, used in zip(mixed, uses) if not used] == [
        r for r, used in zip(without, uses) if not used
    ]


# ---------------------------------------------------------------- the sampled distribution

# Chi-square critical value at p = 1e-3 for 7 degrees of freedom (8 outcomes); the seeds
# are fixed, so the test is deterministic.
CHI2_CRITICAL_7 = 24.32


def test_sampled_frequencies_follow_penalties_and_bias() -> None:
    """Many independent draws of one position: the counts match the processed distribution,
    and clearly do not match the unprocessed one (the test has the power to fail)."""
    vocab, num_draws = 8, 8000
    logits = torch.tensor([[1.0, 0.5, 0.2, 1.2, -0.3, 0.8, 0.0, -1.0]])
    params = {"temperature": 0.9, "presence_penalty": 0.6, "frequency_penalty": 0.4,
              "repetition_penalty": 1.4, "logit_bias": {2: 1.1, 5: -0.7},
              "prompt": [4, 7], "output": [3, 3, 0, 6]}
    rows = [make_row(**params) for _ in range(num_draws)]
    results = Sampler(seed=17)(logits.expand(num_draws, -1), rows)
    counts = torch.bincount(torch.tensor([r.token_ids[0] for r in results]), minlength=vocab)
    probs = reference_logprobs(logits[0], rows[0], 0).exp()
    assert chi_square(counts, probs) < CHI2_CRITICAL_7
    unprocessed = torch.softmax(logits[0].double() / 0.9, -1)
    assert chi_square(counts, unprocessed) > 10 * CHI2_CRITICAL_7


# ---------------------------------------------------------------- masks, one by one


def greedy_tokens(logits: torch.Tensor, rows: list[SamplingRow], **kwargs) -> list[list[int]]:
    return [r.token_ids for r in Sampler(**kwargs)(logits, rows)]


def test_min_tokens_masks_eos_and_stop_ids_before_and_not_from_min_tokens() -> None:
    stop = 7
    logits = torch.zeros(1, 10)
    logits[0, EOS], logits[0, stop], logits[0, 5] = 5.0, 4.0, 3.0
    before = {"temperature": 0.0, "min_tokens": 3, "stop_token_ids": [stop]}
    cases = [  # (output length, kwargs, expected token)
        (2, before, 5),
        (3, before, EOS),
        (4, before, EOS),
        (2, before | {"ignore_eos": True}, EOS),
        (0, {"temperature": 0.0, "min_tokens": 3, "ignore_eos": True, "stop_token_ids": [EOS]},
         stop),  # a stop id is masked even when it is the EOS that ignore_eos leaves alone
    ]
    for num_output, kwargs, expected in cases:
        row = make_row(output=[9] * num_output, **kwargs)
        assert greedy_tokens(logits, [row], eos_token_ids=(EOS,)) == [[expected]], kwargs
    # Without the model's EOS ids the sampler cannot mask EOS (only stop ids).
    row = make_row(output=[9], **before)
    assert greedy_tokens(logits, [row]) == [[EOS]]


def test_min_tokens_boundary_inside_drafts() -> None:
    """Output index first + j: positions before min_tokens mask EOS, the one at it does not."""
    logits = torch.zeros(3, 10)
    logits[:, EOS] = 5.0
    logits[0, 4], logits[1, 6] = 3.0, 3.0
    row = make_row(temperature=0.0, output=[9, 9], min_tokens=4, drafts=[4, 6])
    [tokens] = greedy_tokens(logits, [row], eos_token_ids=(EOS,))
    assert tokens == [4, 6, EOS]


def test_bad_words_single_and_multi_token_follow_the_output_and_drafts() -> None:
    logits = torch.zeros(4, 10)
    logits[:, 3] = 5.0  # 3 is everyone's favourite
    logits[:, 1] = 4.0
    logits[0, 9], logits[1, 7] = 6.0, 6.0  # the drafts, accepted
    words = [[7, 3], [8]]
    # Output ends with 7: 3 banned at position 0 only if the draft path does not allow it.
    row = make_row(temperature=0.0, output=[5, 7], bad_words=words, drafts=[9, 7, 1])
    logits[2, 1] = 6.0
    [tokens] = greedy_tokens(logits, [row])
    # position 0 sees ...7 (3 banned, but 9 wins anyway); 1 sees ...7, 9 (7 wins);
    # 2 sees ...9, 7 (3 banned: 1 wins, the draft); 3 sees ...7, 1 (3 allowed).
    assert tokens == [9, 7, 1, 3]
    single = make_row(temperature=0.0, bad_words=[[3]])
    assert greedy_tokens(logits[3:], [single]) == [[1]]
    # A word whose prefix is not at the very end does not ban its last token.
    elsewhere = make_row(temperature=0.0, output=[7, 5], bad_words=[[7, 3]])
    assert greedy_tokens(logits[3:], [elsewhere]) == [[3]]
    # Prefixes are matched in the output only, never across into the prompt.
    prompt_only = make_row(temperature=0.0, prompt=[7], output=[], bad_words=[[7, 3]])
    assert greedy_tokens(logits[3:], [prompt_only]) == [[3]]


def test_allowed_token_ids_restrict_greedy_and_sampled_rows() -> None:
    logits = random_logits(200, 50, seed=5)
    allowed = [3, 17, 42, 60]  # 60 is past the vocabulary: ignored
    rows = [make_row(temperature=0.0 if i % 2 else 1.0, allowed_token_ids=allowed)
            for i in range(200)]
    results = Sampler()(logits, rows)
    tokens = [r.token_ids[0] for r in results]
    assert set(tokens) == {3, 17, 42}  # 200 draws: each allowed token seen
    for i, result in enumerate(results):
        if i % 2:
            assert tokens[i] == max((3, 17, 42), key=lambda t: logits[i, t])


DEAD_ENDS = {
    "allowed_then_banned": {"allowed_token_ids": [4], "bad_words": [[4]]},
    "allowed_only_eos": {"allowed_token_ids": [EOS], "min_tokens": 5},
    "allowed_past_vocab": {"allowed_token_ids": [64, 70]},
    "allowed_then_stop_id": {"allowed_token_ids": [6], "min_tokens": 1, "stop_token_ids": [6]},
}


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("case", DEAD_ENDS.values(), ids=DEAD_ENDS.keys())
def test_masks_that_allow_nothing_yield_no_token_with_logprob_minus_inf(
    case: dict, greedy: bool
) -> None:
    temperature = {"temperature": 0.0} if greedy else {"seed": 3, "top_p": 0.9}
    rows = [
        make_row(**temperature),
        make_row(**temperature, **case, logprobs=3),
        make_row(**temperature, logprobs=2, drafts=[5]),
    ]
    logits = random_logits(num_positions(rows), 64, seed=6)
    results = Sampler(eos_token_ids=(EOS,))(logits, rows)
    dead = results[1]
    assert dead.token_ids == [NO_ALLOWED_TOKEN_ID] and dead.logprobs == [-math.inf]
    assert dead.top_logprobs == [TopLogprobs([NO_ALLOWED_TOKEN_ID], [-math.inf], [0])]
    assert not any(math.isnan(lp) for r in results for lp in r.logprobs)
    alone = Sampler(eos_token_ids=(EOS,))
    assert [results[0]] == alone(logits[:1], rows[:1])
    assert all(0 <= t < 64 for r in (results[0], results[2]) for t in r.token_ids)


def test_masks_and_the_grammar_bitmask_combine() -> None:
    """The bitmask allows 0..31, allowed_token_ids 20..40, a bad word bans 25: 20..31 bar 25
    remain; with 20..31 banned too, nothing does."""
    vocab = 64
    rows = [
        make_row(temperature=0.0, allowed_token_ids=list(range(20, 41)), bad_words=[[25]],
                 logprobs=20),
        make_row(temperature=0.0, allowed_token_ids=list(range(20, 41)),
                 bad_words=[[t] for t in range(20, 32)]),
    ]
    logits = random_logits(2, vocab, seed=7)
    bitmask = torch.tensor([[-1, 0], [-1, 0]], dtype=torch.int32)  # tokens 0..31
    sampler = Sampler()
    plan = sampler.plan(rows, vocab)
    tensors = {name: torch.from_numpy(a) for name, a in plan.arrays.items()}
    results = sampler.to_results(*sampler.sample_positions(logits, plan, tensors, bitmask), plan)
    kept = [t for t in range(20, 32) if t != 25]
    expected = torch.full((vocab,), -math.inf, dtype=torch.float64)
    expected[kept] = logits[0, kept].double().log_softmax(-1)
    entry = results[0].top_logprobs[0]
    assert set(entry.token_ids[1:12]) == set(kept)
    assert all(close(lp, expected[t].item())
               for t, lp in zip(entry.token_ids, entry.logprobs) if t in kept)
    assert results[0].token_ids == [max(kept, key=lambda t: logits[0, t])]
    assert results[1].token_ids == [NO_ALLOWED_TOKEN_ID]


def test_min_tokens_yields_to_a_grammar_that_allows_only_stop_tokens() -> None:
    """vLLM's rule: a constrained row whose grammar allows only EOS (it is complete) samples
    the EOS even before min_tokens; where the grammar allows more, min_tokens masks EOS. A
    row without a constraint is a dead end as before."""
    from rollout_engine.protocol import StructuredOutputsParams

    vocab = 64
    choice = StructuredOutputsParams(choice=["yes"])
    rows = [
        make_row(temperature=0.0, min_tokens=5, structured_outputs=choice, logprobs=0),
        make_row(seed=1, min_tokens=5, structured_outputs=choice),
        make_row(temperature=0.0, min_tokens=5, structured_outputs=choice),
        make_row(temperature=0.0, min_tokens=5, allowed_token_ids=[EOS]),
    ]
    logits = random_logits(4, vocab, seed=9)
    logits[2, EOS] = 100.0
    only_eos = torch.zeros(4, 2, dtype=torch.int32)
    only_eos[:, 0] = 1 << EOS
    only_eos[2, 1] = 1 << 3  # EOS or token 35
    sampler = Sampler(eos_token_ids=(EOS,))
    plan = sampler.plan(rows, vocab)
    tensors = {name: torch.from_numpy(a) for name, a in plan.arrays.items()}
    results = sampler.to_results(*sampler.sample_positions(logits, plan, tensors, only_eos), plan)
    assert [r.token_ids for r in results] == [[EOS], [EOS], [35], [NO_ALLOWED_TOKEN_ID]]
    assert results[0].logprobs == [0.0] and results[1].logprobs == [0.0]


# ---------------------------------------------------------------- top-k logprobs


def check_top_logprobs(
    result: SampleResult, k: int, dists: list[torch.Tensor]
) -> None:
    """`dists[j]` is the reference distribution of returned position j."""
    assert result.top_logprobs is not None and len(result.top_logprobs) == len(result.token_ids)
    for j, (token, logprob, entry) in enumerate(
        zip(result.token_ids, result.logprobs, result.top_logprobs)
    ):
        dist = dists[j]
        assert entry.token_ids[0] == token and entry.logprobs[0] == logprob
        assert close(logprob, dist[token].item())
        assert entry.ranks[0] == 1 + int((dist > dist[token]).sum()), (j, entry)
        values, ids = dist.topk(min(k, len(dist)))
        assert entry.token_ids[1:] == ids.tolist(), (j, entry.token_ids, ids)
        assert all(close(a, b) for a, b in zip(entry.logprobs[1:], values.tolist()))
        assert entry.ranks[1:] == list(range(1, len(ids) + 1))


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_top_logprobs_match_log_softmax_with_mixed_k_and_drafts(mode: str) -> None:
    vocab = 500
    processed = {"logprobs_mode": mode, "repetition_penalty": 1.2, "presence_penalty": 0.5,
                 "output": [3, 8, 3], "logit_bias": {7: 4.0}}
    specs = [  # (row kwargs, number of drafts)
        ({"temperature": 0.0, "logprobs": 5} | processed, 0),
        ({"temperature": 0.0, "logprobs": 0} | processed, 2),
        ({"temperature": 0.0}, 1),
        ({"seed": 1, "temperature": 0.7, "top_k": 40, "logprobs": 20} | processed, 0),
        ({"seed": 2, "top_p": 0.8, "logprobs": 1} | processed, 3),
        ({"seed": 3, "min_p": 0.05, "logprobs": 3}, 0),
        ({"seed": 4, "logprobs_mode": mode}, 0),  # raw mode without top logprobs
        ({"temperature": 0.0, "logprobs": 20, "logprobs_mode": mode}, 4),
    ]
    logits_parts, rows = [], []
    for index, (kwargs, num_drafts) in enumerate(specs):
        part = random_logits(num_drafts + 1, vocab, scale=2.0, seed=50 + index)
        rows.append(with_argmax_drafts(part, kwargs, num_drafts, bump=5.0))
        logits_parts.append(part)
    logits = torch.cat(logits_parts)
    results = Sampler()(logits, rows)
    offset = 0
    for row, result, part in zip(rows, results, logits_parts):
        k = row.params.logprobs
        if mode == "raw_logprobs" and row.params.logprobs_mode == mode:
            dists = [part[j].double().log_softmax(-1) for j in range(len(part))]
        else:
            dists = [reference_logprobs(part[j], row, j) for j in range(len(part))]
        if k is None:
            assert result.top_logprobs is None
            for j, (token, logprob) in enumerate(zip(result.token_ids, result.logprobs)):
                assert close(logprob, dists[j][token].item())
        else:
            check_top_logprobs(result, k, dists)
        if row.params.is_greedy:
            assert result.num_accepted_drafts == len(row.draft_token_ids)
        offset += len(part)
    assert results[4].num_accepted_drafts >= 1  # a sampled row returned a draft position


def test_raw_logprobs_differ_from_processed_ones_on_the_same_tokens() -> None:
    logits = random_logits(1, 300, seed=8)
    params = {"seed": 5, "temperature": 0.5, "top_k": 10, "logprobs": 4,
              "frequency_penalty": 1.0, "output": [int(logits.argmax())]}
    [processed] = Sampler()(logits, [make_row(**params)])
    [raw] = Sampler()(logits, [make_row(logprobs_mode="raw_logprobs", **params)])
    assert raw.token_ids == processed.token_ids  # the mode changes no token
    token = raw.token_ids[0]
    expected = logits[0].double().log_softmax(-1)
    assert close(raw.logprobs[0], expected[token].item())
    assert abs(processed.logprobs[0] - expected[token]) > 0.1
    assert raw.top_logprobs[0].token_ids[1:] == expected.topk(4).indices.tolist()


def test_vocabulary_smaller_than_k_returns_the_whole_vocabulary() -> None:
    logits = random_logits(1, 5, seed=9)
    [result] = Sampler()(logits, [make_row(temperature=0.0, logprobs=20)])
    assert sorted(result.top_logprobs[0].token_ids[1:]) == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------- determinism and syncs


def surface_batch(target: SamplingRow) -> tuple[list[SamplingRow], int]:
    """`target` among rows using every feature, greedy and drafting rows."""
    others = [
        make_row(temperature=0.0, drafts=[1, 2], bad_words=[[4], [1, 7]], logprobs=3),
        make_row(temperature=0.9, presence_penalty=1.0, output=[5, 5], logprobs=0),
        make_row(seed=1, logit_bias={3: 5.0}, allowed_token_ids=[1, 3, 9], drafts=[3]),
        make_row(seed=2, min_tokens=4, output=[1], logprobs_mode="raw_logprobs"),
        make_row(temperature=0.0, frequency_penalty=2.0, output=[8, 8, 1]),
        make_row(seed=3, top_k=5, logprobs=20, drafts=[0, 0]),
    ]
    return others[:3] + [target] + others[3:], 3


@pytest.mark.parametrize("drafts", [[], [17, 3]])
@pytest.mark.parametrize(
    "params",
    [
        {},
        {"presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {17: 2.0},
         "bad_words": [[5, 17]], "output": [9, 5], "logprobs": 5},
        {"allowed_token_ids": [3, 17, 100, 250], "min_tokens": 3, "top_p": 0.9,
         "logprobs_mode": "raw_logprobs", "logprobs": 2},
    ],
)
def test_seeded_row_does_not_depend_on_the_batch(params: dict, drafts: list[int]) -> None:
    vocab = 256
    target = make_row(seed=42, drafts=drafts, **params)
    rows, index = surface_batch(target)
    parts = [random_logits(len(r.draft_token_ids) + 1, vocab, scale=2.0, seed=i)
             for i, r in enumerate(rows)]
    alone = Sampler(seed=0, eos_token_ids=(EOS,))(parts[index], [target])[0]
    mixed = Sampler(seed=1, eos_token_ids=(EOS,))(torch.cat(parts), rows)[index]
    assert mixed == alone


def test_logprobs_options_draw_nothing() -> None:
    """A seeded row's tokens do not change when it asks for top or raw logprobs."""
    logits = random_logits(4, 100, scale=1.0, seed=10)
    rows = lambda **kw: [make_row(seed=7, sample_index=i, top_p=0.95, **kw) for i in range(4)]
    plain = Sampler(seed=1)(logits, rows())
    for kwargs in ({"logprobs": 20}, {"logprobs": 0, "logprobs_mode": "raw_logprobs"}):
        assert [r.token_ids for r in Sampler(seed=2)(logits, rows(**kwargs))] == [
            r.token_ids for r in plain
        ]


def test_every_feature_at_once_never_syncs_before_its_one_copy() -> None:
    rows, _ = surface_batch(make_row(seed=4, logprobs=2, drafts=[6]))
    logits = random_logits(num_positions(rows), 64)
    bitmask = torch.full((num_positions(rows), 2), -1, dtype=torch.int32)
    bitmask[0, 0] = 0  # tokens 0..31 forbidden at the first position
    sampler = Sampler(exact_in_one_pass=True, eos_token_ids=(EOS,))
    plan = sampler.plan(rows, 64)
    assert plan.processing == LogitsProcessing(True, True, False, True)
    tensors = {name: torch.from_numpy(a) for name, a in plan.arrays.items()}
    with SyncCounter() as counter:
        results = sampler.to_results(
            *sampler.sample_positions(logits, plan, tensors, bitmask), plan
        )
    assert counter.syncs == Counter()
    assert results[0].token_ids[0] >= 32 and results[0].top_logprobs[0].ranks[0] >= 1


def test_plain_batch_plans_nothing_extra() -> None:
    rows = [make_row(temperature=0.0), make_row(seed=1, top_k=5, drafts=[3])]
    plan = Sampler().plan(rows, 64)
    assert plan.processing == LogitsProcessing()
    assert plan.num_top_logprobs is None and plan.num_top_positions == 0
    assert set(plan.arrays) == {"greedy_positions", "sampled_positions", "uniforms",
                                "sort_rows", "top_k", "top_p"}


# ---------------------------------------------------------------- rows from step requests


def step_request(params: SamplingParams, bad_words: list[list[int]]) -> StepRequest:
    """A request with prompt [1, 2, 3, 4] and output [6, 7, 8], verifying drafts [4, 5]."""
    output = SchedulerOutput()
    output.new_requests.append(NewRequestData("r", [1, 2, 3, 4], [6, 7, 8], params, 0,
                                              bad_words_token_ids=bad_words))
    output.scheduled_requests.append(ScheduledRequest(
        request_id="r", start_position=6, num_tokens=3, new_token_ids=[], new_block_ids=[0, 1],
        spec_token_ids=[4, 5], needs_sample=True, num_output_tokens=3,
    ))
    [request] = PersistentBatch().update(output)
    return request


@pytest.mark.parametrize(
    "params, bad_words, has_history",
    [
        (SamplingParams(), [], False),
        (SamplingParams(), [[5]], False),  # one-token words read no history
        (SamplingParams(), [[7, 5]], True),
        (SamplingParams(presence_penalty=0.1), [], True),
        (SamplingParams(frequency_penalty=0.1), [], True),
        (SamplingParams(repetition_penalty=1.1), [], True),
    ],
)
def test_sampling_row_fills_history_only_when_read(
    params: SamplingParams, bad_words: list[list[int]], has_history: bool
) -> None:
    row = sampling_row(step_request(params, bad_words))
    assert row.token_history == ([1, 2, 3, 4, 6, 7, 8] if has_history else [])
    assert (row.num_prompt_tokens, row.first_output_index) == (4, 3)
    assert row.draft_token_ids == [4, 5] and row.bad_words_token_ids == bad_words


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_matches_cpu_with_every_feature() -> None:
    rows, _ = surface_batch(make_row(seed=9, logprobs=20, drafts=[3, 4], bad_words=[[4]]))
    logits = random_logits(num_positions(rows), 4096, seed=12)
    on_cpu = Sampler(seed=3, eos_token_ids=(EOS,))(logits, rows)
    on_cuda = Sampler(seed=3, eos_token_ids=(EOS,))(logits.cuda(), rows)
    for cpu_result, cuda_result in zip(on_cpu, on_cuda):
        assert cpu_result.token_ids == cuda_result.token_ids
        assert max(abs(a - b) for a, b in zip(cpu_result.logprobs, cuda_result.logprobs)) <= 1e-4
        for a, b in zip(cpu_result.top_logprobs or [], cuda_result.top_logprobs or []):
            # Filtered tokens tie at -inf, in any order: compare the finite entries.
            def finite(entry: TopLogprobs) -> list[tuple[int, int]]:
                return [(t, r) for t, lp, r in zip(entry.token_ids, entry.logprobs, entry.ranks)
                        if lp > -math.inf]

            assert finite(a) == finite(b)
