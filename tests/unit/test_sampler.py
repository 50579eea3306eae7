"""Tests of the sampler: filters, logprobs, seeded streams, speculative verification."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from rollout_engine.core.scheduler_output import NO_ALLOWED_TOKEN_ID
from rollout_engine.protocol import SamplingParams
from rollout_engine.worker.sampling.sampler import (
    Sampler,
    SampleResult,
    SamplingRow,
    apply_repetition_penalty,
    filter_logits,
    position_uniform,
    request_stream_seed,
)

# Chi-square critical values at p = 1e-3; the seeds are fixed, so the tests are deterministic.
CHI2_CRITICAL_1E3 = {4: 18.47, 5: 20.52, 8: 26.12}


def make_row(
    *,
    seed: int | None = None,
    sample_index: int = 0,
    output_index: int = 0,
    history: list[int] | None = None,
    drafts: list[int] | None = None,
    **params: float,
) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**params),
        stream_seed=None if seed is None else request_stream_seed(seed, sample_index),
        token_history=list(history or []),
        draft_token_ids=list(drafts or []),
        first_output_index=output_index,
    )


def random_logits(
    num_rows: int, vocab_size: int, scale: float = 3.0, seed: int = 0
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * scale


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed `counts` against expected `probs`; an outcome with
    expected probability 0 that was observed makes it infinite."""
    expected = probs.double() * counts.sum()
    if bool((counts[expected == 0] > 0).any()):
        return float("inf")
    counts, expected = counts[expected > 0].double(), expected[expected > 0]
    return float(((counts - expected) ** 2 / expected).sum())


def first_tokens(results: list[SampleResult]) -> torch.Tensor:
    return torch.tensor([r.token_ids[0] for r in results])


# ---------------------------------------------------------------- greedy and logprobs


def test_greedy_is_argmax_and_logprob_is_log_softmax() -> None:
    logits = random_logits(16, 300)
    results = Sampler()(logits, [make_row(temperature=0.0) for _ in range(16)])
    expected = logits.argmax(-1)
    expected_logprobs = torch.log_softmax(logits, -1).gather(1, expected[:, None]).squeeze(1)
    assert [r.token_ids for r in results] == [[t] for t in expected.tolist()]
    assert all(r.num_accepted_drafts == 0 for r in results)
    got = torch.tensor([r.logprobs[0] for r in results])
    torch.testing.assert_close(got, expected_logprobs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_logprobs_equal_log_softmax_of_scaled_logits(temperature: float) -> None:
    logits = random_logits(64, 1000, seed=1)
    rows = [make_row(temperature=temperature, seed=i) for i in range(64)]
    results = Sampler()(logits, rows)
    tokens = torch.tensor([r.token_ids[0] for r in results])
    expected = torch.log_softmax(logits / temperature, -1).gather(1, tokens[:, None]).squeeze(1)
    got = torch.tensor([r.logprobs[0] for r in results])
    assert (got - expected).abs().max() <= 1e-6


def test_half_precision_logits_are_upcast() -> None:
    logits = random_logits(8, 200).to(torch.bfloat16)
    rows = [make_row(temperature=0.0) for _ in range(4)] + [make_row(seed=i) for i in range(4)]
    got = Sampler()(logits, rows)
    expected = Sampler()(logits.float(), rows[:4] + [make_row(seed=i) for i in range(4)])
    assert got == expected


# ---------------------------------------------------------------- filters


def reference_filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Slow float64 reference of top-k, then top-p, then min-p for one row."""
    values, order = logits.double().sort(descending=True)
    keep = torch.ones_like(values, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    probs = torch.where(keep, values, float("-inf")).softmax(-1)
    if top_p < 1.0:
        keep &= probs.cumsum(-1) - probs < top_p
        probs = torch.where(keep, values, float("-inf")).softmax(-1)
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    removed = torch.empty_like(keep).scatter_(0, order, ~keep)
    return logits.masked_fill(removed, float("-inf"))


FILTER_CASES = [  # (top_k, top_p, min_p)
    (5, 1.0, 0.0),
    (-1, 0.7, 0.0),
    (-1, 1.0, 0.1),
    (10, 0.8, 0.0),
    (10, 0.8, 0.05),
    (-1, 0.95, 0.02),
]


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
def test_filter_logits_matches_reference(scale: float) -> None:
    # Flat rows (scale 0.5) need the full-sort fallback of top-p, peaked rows do not.
    vocab_size = 2048
    cases = FILTER_CASES + [(100, 1.0, 0.0), (3000, 0.9, 0.0), (1, 0.5, 0.3)]
    logits = random_logits(len(cases), vocab_size, scale=scale, seed=2)
    top_k = torch.tensor([c[0] for c in cases])
    top_p = torch.tensor([c[1] for c in cases])
    min_p = torch.tensor([c[2] for c in cases])
    got = filter_logits(logits, top_k, top_p, min_p)
    for row, (k, p, m) in enumerate(cases):
        expected = reference_filter(logits[row], k, p, m)
        assert torch.equal(got[row].isinf(), expected.isinf()), f"case {cases[row]}"
        assert torch.equal(got[row][~got[row].isinf()], logits[row][~expected.isinf()])


def test_filter_logits_off_is_identity() -> None:
    logits = random_logits(4, 500)
    off = filter_logits(logits, torch.full((4,), -1), torch.ones(4), torch.zeros(4))
    assert torch.equal(off, logits)


@pytest.mark.parametrize("top_k", [-1, 3, 100])
@pytest.mark.parametrize("top_p", [1e-50, 1e-12])
def test_top_p_always_keeps_the_most_likely_token(top_p: float, top_k: int) -> None:
    """vLLM's rule: whatever top_p, the nucleus holds the most likely token. Before the fix
    top_p=1e-50 (0 in float32) removed every token: token vocab-1 with a NaN logprob."""
    num_rows, vocab_size = 6, 2048
    logits = random_logits(num_rows, vocab_size, scale=0.5, seed=5)  # flat: full-sort fallback
    filtered = filter_logits(logits, torch.full((num_rows,), top_k), torch.full((num_rows,), top_p),
                             torch.zeros(num_rows))
    assert torch.equal(filtered.isfinite().sum(-1), torch.ones(num_rows, dtype=torch.long))
    assert torch.equal(filtered.argmax(-1), logits.argmax(-1))
    rows = [make_row(seed=i, top_p=top_p, top_k=top_k, logprobs=1) for i in range(num_rows)]
    results = Sampler(seed=0)(logits, rows)
    assert first_tokens(results).tolist() == logits.argmax(-1).tolist()
    assert all(r.logprobs == [0.0] and r.top_logprobs[0].logprobs == [0.0, 0.0] for r in results)


@pytest.mark.parametrize("case", FILTER_CASES)
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_tokens_stay_inside_the_filtered_set(
    case: tuple[int, float, float], temperature: float
) -> None:
    top_k, top_p, min_p = case
    num_draws, vocab_size = 2000, 40
    logits = random_logits(1, vocab_size, scale=2.0, seed=3)
    allowed_logits = reference_filter(logits[0] / temperature, top_k, top_p, min_p)
    allowed_logprobs = allowed_logits.double().log_softmax(-1)
    params = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    results = Sampler(seed=4)(logits.expand(num_draws, -1), [make_row(**params)] * num_draws)
    tokens = first_tokens(results)
    assert not allowed_logits[tokens].isinf().any(), "sampled a filtered-out token"
    likely = (allowed_logprobs.exp() > 0.01).nonzero().squeeze(1)
    assert set(likely.tolist()) <= set(tokens.tolist()), "an allowed token was never sampled"
    got = torch.tensor([r.logprobs[0] for r in results], dtype=torch.float64)
    assert (got - allowed_logprobs[tokens]).abs().max() <= 1e-5


def test_empirical_distribution_matches_softmax() -> None:
    vocab_size, temperature, num_draws = 6, 0.8, 24000
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.5]])
    sampler = Sampler(seed=5)
    counts = torch.zeros(vocab_size)
    for _ in range(num_draws // 4000):
        rows = [make_row(temperature=temperature)] * 4000
        counts += torch.bincount(first_tokens(sampler(logits.expand(4000, -1), rows)), minlength=6)
    probs = torch.softmax(logits[0] / temperature, -1)
    assert chi_square(counts, probs) < CHI2_CRITICAL_1E3[5]


# ---------------------------------------------------------------- repetition penalty


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hugging_face(penalty: float) -> None:
    vocab_size = 30
    history = [3, 7, 7, 0, 29, 12, 3, 45]  # 45 is outside the vocabulary: ignored, as in HF
    logits = random_logits(1, vocab_size, seed=6)
    logits[0, 12] = 0.0
    hf = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), logits.clone())
    rows = [make_row(repetition_penalty=penalty, history=history)]
    assert torch.equal(apply_repetition_penalty(logits, rows, [0, 1]), hf)
    # Through the sampler: greedy logprobs are the log-softmax of the penalised logits.
    [result] = Sampler()(
        logits, [make_row(temperature=0.0, repetition_penalty=penalty, history=history)]
    )
    assert result.token_ids == [int(hf.argmax())]
    assert abs(result.logprobs[0] - float(hf.log_softmax(-1)[0, hf.argmax()])) <= 1e-6


def test_repetition_penalty_counts_earlier_drafts() -> None:
    # Position j sees history + drafts[:j]; drafts are the penalised argmaxes, so all are
    # accepted, and position 1 only picks token 4 if draft 5 (its raw argmax) is penalised.
    history, penalty = [1, 2], 2.0
    logits = torch.tensor(
        [
            [0.0, 3.0, 0.0, 0.0, 0.5, 2.0],  # 1 penalised to 1.5, argmax 5
            [0.0, 0.0, 0.0, 0.0, 1.5, 2.0],  # 5 penalised to 1.0 (draft 0), argmax 4
            [0.0, 0.0, 0.0, 3.0, 2.0, 2.5],  # 4 and 5 penalised, argmax 3
        ]
    )
    drafts = [5, 4]
    row = make_row(temperature=0.0, repetition_penalty=penalty, history=history, drafts=drafts)
    [result] = Sampler()(logits, [row])
    assert result.token_ids == [5, 4, 3] and result.num_accepted_drafts == 2
    for j, token in enumerate(result.token_ids):
        seen = torch.tensor([history + drafts[:j]])
        hf = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits[j : j + 1].clone())
        assert abs(result.logprobs[j] - float(hf.log_softmax(-1)[0, token])) <= 1e-6


# ---------------------------------------------------------------- seeded streams


def test_request_streams_are_reproducible_and_distinct_per_sample() -> None:
    seeds = [request_stream_seed(7, i) for i in range(8)] + [request_stream_seed(8, 1),
                                                             request_stream_seed(-1, 1)]
    assert len(set(seeds)) == len(seeds)
    assert request_stream_seed(7, 3) == request_stream_seed(7, 3)
    uniforms = [position_uniform(seeds[0], i) for i in range(20000)]
    assert all(0.0 <= u < 1.0 for u in uniforms) and len(set(uniforms)) == len(uniforms)
    counts = torch.histc(torch.tensor(uniforms), bins=10, min=0.0, max=1.0)
    assert chi_square(counts, torch.full((10,), 0.1)) < 27.88  # df 9, p = 1e-3


def generate_seeded(seed: int, sample_index: int, sampler_seed: int) -> list[int]:
    """Ten sampled steps on fixed logits from one seeded stream."""
    sampler = Sampler(seed=sampler_seed)
    logits = random_logits(10, 100, scale=1.0, seed=8)
    rows = [make_row(seed=seed, sample_index=sample_index, output_index=i, top_k=20)
            for i in range(10)]
    return [sampler(logits[i : i + 1], [rows[i]])[0].token_ids[0] for i in range(10)]


def test_same_seed_same_tokens_and_samples_differ() -> None:
    assert generate_seeded(11, 0, sampler_seed=0) == generate_seeded(11, 0, sampler_seed=99)
    assert generate_seeded(11, 1, sampler_seed=0) == generate_seeded(11, 1, sampler_seed=5)
    assert generate_seeded(11, 0, sampler_seed=0) != generate_seeded(11, 1, sampler_seed=0)


def mixed_batch(target: SamplingRow, position: int) -> tuple[list[SamplingRow], int]:
    """`target` among greedy, default-stream, seeded and drafting rows; its index."""
    others = [
        make_row(temperature=0.0, drafts=[1, 2]),
        make_row(temperature=0.9, top_k=3),
        make_row(seed=1, top_p=0.5, drafts=[4]),
        make_row(temperature=1.3, repetition_penalty=1.5, history=[1, 2, 3]),
        make_row(seed=2, top_k=200, min_p=0.1),
        make_row(temperature=0.0),
    ]
    rows = others[:position] + [target] + others[position:]
    return rows, position


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.01, "repetition_penalty": 1.2},
        {"temperature": 1.0, "top_p": 0.95},
    ],
)
@pytest.mark.parametrize("drafts", [[], [17, 3, 250]])
def test_seeded_row_does_not_depend_on_batch(params: dict, drafts: list[int]) -> None:
    vocab_size, history = 256, [5, 17, 3]
    alone_sampler, batch_sampler = Sampler(seed=0), Sampler(seed=1)
    for step in range(3):

        def logits_of(row: SamplingRow, offset: int, step: int = step) -> torch.Tensor:
            num_positions = len(row.draft_token_ids) + 1
            return random_logits(num_positions, vocab_size, scale=2.0, seed=100 * step + offset)

        target = make_row(seed=42 + step, history=history, drafts=drafts, **params)
        alone = alone_sampler(logits_of(target, 0), [target])[0]
        target = make_row(seed=42 + step, history=history, drafts=drafts, **params)
        rows, index = mixed_batch(target, position=step * 2)
        batch_logits = torch.cat(
            [logits_of(row, 0 if i == index else i + 1) for i, row in enumerate(rows)]
        )
        assert batch_sampler(batch_logits, rows)[index] == alone


@pytest.mark.parametrize("drafts", [[17], [17, 3, 250], [0, 0, 0, 0]])
def test_seeded_tokens_do_not_depend_on_drafting(drafts: list[int]) -> None:
    """A drafting step returns exactly the tokens that plain steps at the same output
    positions (with the same distributions) would sample, up to the first rejection."""
    vocab_size = 256
    logits = random_logits(len(drafts) + 1, vocab_size, scale=0.5, seed=4)
    logits[0, drafts[0]] = 4.0  # a likely first draft: some runs accept it
    params = {"temperature": 0.9, "top_p": 0.95}
    for seed in range(20):
        row = make_row(seed=seed, output_index=5, drafts=drafts, **params)
        drafted = Sampler(seed=1)(logits, [row])[0]
        plain = [
            Sampler(seed=2)(logits[j : j + 1], [make_row(seed=seed, output_index=5 + j, **params)])
            [0].token_ids[0]
            for j in range(len(drafts) + 1)
        ]
        a = drafted.num_accepted_drafts
        assert drafted.token_ids == plain[: a + 1]
        assert plain[:a] == drafts[:a] and (a == len(drafts) or plain[a] != drafts[a])


# ---------------------------------------------------------------- speculative verification


@pytest.mark.parametrize("num_accepted", [0, 1, 2, 3])
def test_greedy_verification_accepts_matching_prefix(num_accepted: int) -> None:
    drafts, vocab_size = [4, 9, 2], 12
    logits = random_logits(4, vocab_size, seed=9)
    targets = [4, 9, 2, 7]  # the target's argmax at each position when everything matches
    if num_accepted < 3:
        targets[num_accepted] = 5  # first mismatch
    for j, token in enumerate(targets):
        logits[j, token] = 10.0
    row = make_row(temperature=0.0, drafts=drafts)
    rows = [make_row(temperature=0.0)] + [row]  # an ordinary row first shifts the offsets
    result = Sampler()(torch.cat([random_logits(1, vocab_size), logits]), rows)[1]
    assert result.num_accepted_drafts == num_accepted
    assert result.token_ids == targets[: num_accepted + 1]
    expected = logits.log_softmax(-1)[torch.arange(num_accepted + 1), result.token_ids]
    torch.testing.assert_close(torch.tensor(result.logprobs), expected, rtol=0, atol=1e-6)


# Three positions over a vocabulary of 5, two drafts: p_0(d_0) = 0.3, p_1(d_1) = 0.5.
SPEC_PROBS = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.15, 0.10],
        [0.10, 0.20, 0.05, 0.50, 0.15],
        [0.40, 0.10, 0.10, 0.20, 0.20],
    ]
)
SPEC_DRAFTS = [0, 3]


def outcome_index(token_ids: list[int]) -> int:
    """The returned pair: (x, stop) -> x when only one token came back, (x, y) -> 5 + y after
    the first draft (x = d_0) was accepted."""
    if len(token_ids) == 1:
        return token_ids[0]
    assert token_ids[0] == SPEC_DRAFTS[0]
    return 5 + token_ids[1]


def outcome_probs() -> torch.Tensor:
    """Under the target: (x, stop) has p_0(x) for x != d_0, and 0 for d_0; (d_0, y) has
    p_0(d_0) p_1(y)."""
    p0, p1 = SPEC_PROBS[0], SPEC_PROBS[1]
    stop = p0.clone()
    stop[SPEC_DRAFTS[0]] = 0.0
    return torch.cat([stop, p0[SPEC_DRAFTS[0]] * p1])  # [10]


def spec_statistics(returned: list[list[int]]) -> tuple[float, float, float]:
    """Chi-square of the first token vs p_0, of the returned pair vs the target's, and of the
    bonus token (both drafts accepted) vs p_2."""
    first = torch.bincount(torch.tensor([t[0] for t in returned]), minlength=5)
    pairs = torch.bincount(torch.tensor([outcome_index(t) for t in returned]), minlength=10)
    bonus = torch.bincount(torch.tensor([t[2] for t in returned if len(t) == 3]), minlength=5)
    return (
        chi_square(first, SPEC_PROBS[0]),
        chi_square(pairs, outcome_probs()),
        chi_square(bonus, SPEC_PROBS[2]),
    )


def inline_verification(
    num_draws: int, zero_rejected_draft: bool, always_accept: bool
) -> list[list[int]]:
    """A plain re-implementation of the rule that can be made wrong on purpose."""
    generator = torch.Generator().manual_seed(13)
    returned = []
    for _ in range(num_draws):
        tokens: list[int] = []
        for j, draft in enumerate(SPEC_DRAFTS):
            if always_accept or torch.rand(1, generator=generator).item() < SPEC_PROBS[j, draft]:
                tokens.append(draft)
                continue
            residual = SPEC_PROBS[j].clone()
            if zero_rejected_draft:
                residual[draft] = 0.0
            tokens.append(int(torch.multinomial(residual, 1, generator=generator)))
            break
        else:
            tokens.append(int(torch.multinomial(SPEC_PROBS[2], 1, generator=generator)))
        returned.append(tokens)
    return returned


def test_sampling_verification_is_exact() -> None:
    num_draws, logits = 12000, SPEC_PROBS.log()
    sampler = Sampler(seed=21)
    rows = [make_row(drafts=SPEC_DRAFTS) for _ in range(num_draws)]
    results = sampler(logits.repeat(num_draws, 1), rows)
    returned = [r.token_ids for r in results]
    assert all(len(r.token_ids) == r.num_accepted_drafts + 1 for r in results)
    assert all(
        r.token_ids[: r.num_accepted_drafts] == SPEC_DRAFTS[: r.num_accepted_drafts]
        for r in results
    )
    first, pair, bonus = spec_statistics(returned)
    assert (
        first < CHI2_CRITICAL_1E3[4]
        and pair < CHI2_CRITICAL_1E3[8]
        and bonus < CHI2_CRITICAL_1E3[4]
    )
    # Reported logprobs are the target's log p_j(token), also for a resampled token.
    for r in results[:500]:
        expected = [float(SPEC_PROBS[j, t].log()) for j, t in enumerate(r.token_ids)]
        assert max(abs(a - b) for a, b in zip(r.logprobs, expected)) <= 1e-6


@pytest.mark.parametrize(
    "zero_rejected_draft, always_accept, is_right",
    [(False, False, False), (True, True, False), (True, False, True)],
    ids=["no-zeroing", "accept-always", "right-rule"],
)
def test_wrong_verification_rules_fail_the_same_bounds(
    zero_rejected_draft: bool, always_accept: bool, is_right: bool
) -> None:
    # The inline variant with the right rule passes, so the failures come from the rule.
    returned = inline_verification(12000, zero_rejected_draft, always_accept)
    first, pair, _ = spec_statistics(returned)
    passes = first < CHI2_CRITICAL_1E3[4] and pair < CHI2_CRITICAL_1E3[8]
    assert passes == is_right, f"first={first:.1f} pair={pair:.1f}"


def test_draft_outside_top_k_is_always_rejected() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    rows = [make_row(top_k=1, drafts=[1]) for _ in range(200)]
    results = Sampler()(logits.repeat(200, 1), rows)
    assert all(r.token_ids == [0] and r.num_accepted_drafts == 0 for r in results)
    assert all(r.logprobs == [0.0] for r in results)  # p(0) = 1 after top-k


def test_certain_draft_is_always_accepted_then_bonus() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    rows = [make_row(top_k=1, drafts=[0]) for _ in range(200)]
    results = Sampler()(logits.repeat(200, 1), rows)
    assert all(r.token_ids == [0, 2] and r.num_accepted_drafts == 1 for r in results)


def test_mixed_batch_keeps_row_order() -> None:
    vocab_size = 64
    rows = [
        make_row(temperature=0.0, drafts=[1, 2]),
        make_row(seed=0),
        make_row(temperature=0.0),
        make_row(seed=1, drafts=[3]),
        make_row(temperature=0.0, drafts=[5]),
    ]
    logits = random_logits(9, vocab_size, seed=10)
    results = Sampler()(logits, rows)
    assert torch.equal(logits, random_logits(9, vocab_size, seed=10)), "logits were modified"
    assert len(results) == len(rows)
    assert results[2].token_ids == [int(logits[4].argmax())]
    for result, row in zip(results, rows):
        assert len(result.token_ids) == len(result.logprobs) == result.num_accepted_drafts + 1
        assert result.num_accepted_drafts <= len(row.draft_token_ids)


def sample_masked(
    logits: torch.Tensor, rows: list[SamplingRow], bitmask: torch.Tensor
) -> list[SampleResult]:
    """The sampler's call as the model runner makes it under structured outputs."""
    sampler = Sampler()
    plan = sampler.plan(rows, logits.shape[1])
    tensors = {name: torch.from_numpy(a) for name, a in plan.arrays.items()}
    return sampler.to_results(*sampler.sample_positions(logits, plan, tensors, bitmask), plan)


def test_a_position_whose_mask_allows_no_token_yields_no_token_and_no_nan() -> None:
    """A grammar that dead-ends: its row of the bitmask allows nothing, or only an id past the
    model's vocabulary (a token the tokenizer added). Before the fix, the greedy row got token 0
    with a NaN logprob."""
    vocab_size = 64
    rows = [
        make_row(temperature=0.0),
        make_row(temperature=0.0),  # dead: nothing allowed
        make_row(seed=1, top_p=0.9),  # dead: only id 64, past the vocabulary
        make_row(temperature=0.0, drafts=[5, 6]),  # dead after its first draft
        make_row(seed=2),
    ]
    logits = random_logits(7, vocab_size, seed=11)
    logits[3, 5] = 100.0  # the first draft is the target's token: accepted
    bitmask = torch.full((7, 3), -1, dtype=torch.int32)  # 3 words: ids up to 95
    bitmask[1] = 0
    bitmask[2] = torch.tensor([0, 0, 1], dtype=torch.int32)
    bitmask[4] = 0
    results = sample_masked(logits, rows, bitmask)
    assert [r.token_ids[-1] for r in results[1:3]] == [NO_ALLOWED_TOKEN_ID] * 2
    assert results[3].token_ids == [5, NO_ALLOWED_TOKEN_ID], results[3]
    assert not any(math.isnan(lp) for r in results for lp in r.logprobs), results
    unmasked = sample_masked(logits, rows, torch.full((7, 3), -1, dtype=torch.int32))
    for i in (0, 4):
        assert results[i] == unmasked[i], "a row whose mask allows tokens is unaffected"
    assert all(0 <= t < vocab_size for r in unmasked for t in r.token_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_logits_match_cpu() -> None:
    # The uniforms come from the CPU either way, so the tokens agree with the CPU path.
    def batch() -> list[SamplingRow]:
        rows, _ = mixed_batch(make_row(seed=9, top_p=0.9, drafts=[3, 4]), position=2)
        return rows

    num_positions = sum(len(row.draft_token_ids) + 1 for row in batch())
    logits = random_logits(num_positions, 4096, seed=12)
    on_cpu = Sampler(seed=3)(logits, batch())
    on_cuda = Sampler(seed=3)(logits.cuda(), batch())
    for cpu_result, cuda_result in zip(on_cpu, on_cuda):
        assert cpu_result.token_ids == cuda_result.token_ids
        assert max(abs(a - b) for a, b in zip(cpu_result.logprobs, cuda_result.logprobs)) <= 1e-4


def test_vectorised_uniforms_equal_the_scalar_ones() -> None:
    import numpy as np

    from rollout_engine.worker.sampling.sampler import position_uniforms

    seeds = [request_stream_seed(s, i) for s in (0, 1, -5, 2**70 + 3) for i in range(3)]
    indices = list(range(0, 4000, 333))
    pairs = [(s, i) for s in seeds for i in indices]
    got = position_uniforms(np.array([s for s, _ in pairs], dtype=np.uint64),
                            np.array([i for _, i in pairs], dtype=np.int64))
    assert got.tolist() == [position_uniform(s, i) for s, i in pairs]


def _full_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The plain definition: first index whose float64 cumulative mass exceeds u * total."""
    cdf = probs.double().cumsum(-1)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=probs.shape[1] - 1)


@pytest.mark.parametrize("vocab", [5, 256, 1000, 8192])
def test_two_level_inverse_cdf_equals_the_full_cumsum(vocab: int) -> None:
    from rollout_engine.worker.sampling.rejection_sampler import inverse_cdf_sample

    gen = torch.Generator().manual_seed(vocab)
    probs = torch.randn(64, vocab, generator=gen).mul(3).softmax(-1)
    probs[probs < probs.median()] = 0.0  # half the vocabulary has no mass
    probs[0] = 0.0
    probs[0, vocab - 1] = 1.0  # all mass on the last token (the padded block's edge)
    probs[1] = 0.0
    probs[1, 0] = 0.5  # two tokens in different blocks
    probs[1, vocab // 2] = 0.5
    uniforms = torch.rand(64, generator=gen)
    uniforms[:4] = torch.tensor([0.0, 0.5, 1.0 - 2**-24, 0.999999])
    tokens = inverse_cdf_sample(probs, uniforms)
    assert (probs.gather(1, tokens[:, None]) > 0).all(), "a token with no mass was drawn"
    same = tokens == _full_cdf_sample(probs, uniforms)
    # Both are inverse CDFs of the same u; only a u within rounding of a boundary may differ.
    assert same.float().mean() >= 0.98, tokens[~same]
    assert tokens[0] == vocab - 1 and tokens[1] == (0 if uniforms[1] < 0.5 else vocab // 2)
