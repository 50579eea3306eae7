"""Turns target logits into tokens: repetition penalty, temperature, filters, random draws.

Draft verification (greedy and rejection sampling) lives in `rejection_sampler`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from rollout_engine.protocol import SamplingParams
from rollout_engine.worker.rejection_sampler import (
    SampleResult,
    greedy_verify,
    rejection_sample,
    select_rows,
)

_MASK_64 = (1 << 64) - 1
# Top-p first looks for its nucleus among this many most likely tokens (a partial sort),
# and falls back to a full sort only for rows whose nucleus reaches past them.
_NUM_TOP_P_CANDIDATES = 64


@dataclass
class SamplingRow:
    """One request's sampling context for this step."""

    params: SamplingParams
    stream_seed: int | None
    """The request's own random stream (`request_stream_seed`), or None: a fresh stream
    drawn from the sampler's default one, in row order."""
    token_history: list[int]
    """Prompt + committed output tokens (for repetition_penalty)."""
    draft_token_ids: list[int]
    """Speculative drafts to verify ([] for a plain step)."""
    first_output_index: int = 0
    """Output index of the row's first sampled position (= its committed output tokens)."""


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK_64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return x ^ (x >> 31)


def request_stream_seed(seed: int, sample_index: int) -> int:
    """The random stream of sample `sample_index` of a prompt seeded with `seed`: the `n`
    samples of one prompt differ from each other, but not from run to run."""
    assert sample_index >= 0, f"sample_index must be >= 0, got {sample_index}"
    return _splitmix64(_splitmix64(seed & _MASK_64) ^ sample_index)


def position_uniform(stream_seed: int, output_index: int) -> float:
    """The uniform in [0, 1) of one output position of one stream (counter-based: no state).

    Every sampled token is drawn with the uniform of its own position, so a seeded request's
    tokens depend on its seed, prompt and parameters only: not on the batch it shares, on
    preemption, or on how many drafts were verified around it.
    """
    return (_splitmix64(stream_seed ^ _splitmix64(output_index)) >> 11) * 2.0**-53


def _row_offsets(rows: list[SamplingRow]) -> list[int]:
    """offsets[i] is row i's first logits row; offsets[-1] is the number of logits rows."""
    offsets = [0]
    for row in rows:
        offsets.append(offsets[-1] + len(row.draft_token_ids) + 1)
    return offsets


def apply_repetition_penalty(
    logits: torch.Tensor, rows: list[SamplingRow], offsets: list[int]
) -> torch.Tensor:
    """Hugging Face's rule: a seen token's logit is divided by the penalty if > 0, else
    multiplied. Position j of a row has also seen drafts[:j]. Ids >= vocab are ignored."""
    num_positions, vocab_size = logits.shape
    penalised_rows = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not penalised_rows:
        return logits
    seen = torch.zeros(num_positions, vocab_size, dtype=torch.bool)  # [num_positions, vocab]
    penalty = torch.ones(num_positions, 1)  # [num_positions, 1]
    for i in penalised_rows:
        row, start, end = rows[i], offsets[i], offsets[i + 1]
        history = torch.tensor(row.token_history, dtype=torch.long)
        seen[start:end, history[history < vocab_size]] = True
        for j, draft_id in enumerate(row.draft_token_ids):
            seen[start + j + 1 : end, draft_id] = True
        penalty[start:end] = row.params.repetition_penalty
    seen, penalty = seen.to(logits.device), penalty.to(logits.device)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def _top_k_top_p_removed(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of tokens that top-k then top-p remove, looking only at the `num_candidates` most
    likely tokens of each row, and which rows that was enough for (`is_exact`)."""
    # logits [S, V]; top_k [S] in 1..V (V = off); top_p [S] in (0, 1] (1 = off)
    vocab_size = logits.shape[1]
    values, ids = logits.topk(num_candidates, dim=-1)  # [S, K], descending
    kth_value = values.gather(1, (top_k.clamp(max=num_candidates) - 1)[:, None])  # [S, 1]
    kth_value = kth_value.masked_fill(top_k[:, None] > num_candidates, float("-inf"))
    removed = logits < kth_value  # top-k; ties with the k-th token are kept, as in HF
    num_allowed_by_top_k = (~removed).sum(-1)  # [S]
    # Nucleus: the smallest prefix of the (top-k renormalised) sorted probs with mass >= top_p.
    log_z = logits.masked_fill(removed, float("-inf")).logsumexp(-1, keepdim=True)  # [S, 1]
    probs = (values.masked_fill(values < kth_value, float("-inf")) - log_z).exp()  # [S, K]
    kept_sorted = probs.cumsum(-1) - probs < top_p[:, None]  # mass strictly before < top_p
    nucleus_removed = torch.ones_like(removed).scatter_(1, ids, ~kept_sorted)
    uses_top_p = top_p < 1.0
    removed = torch.where(uses_top_p[:, None], removed | nucleus_removed, removed)
    # The nucleus may reach past the candidates only if the last one is kept and top-k
    # leaves more tokens than there are candidates.
    reaches_past = kept_sorted[:, -1] & (num_allowed_by_top_k > num_candidates)
    is_exact = ~uses_top_p | ~reaches_past | (num_candidates == vocab_size)
    return removed, is_exact


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Top-k, then top-p, then min-p; removed tokens get -inf. One (partial) sort per batch."""
    # logits [S, V] (temperature already applied); top_k [S] (-1 = off); top_p, min_p [S]
    vocab_size = logits.shape[1]
    top_k = torch.where((top_k < 1) | (top_k > vocab_size), vocab_size, top_k)
    needs_sort = ((top_k < vocab_size) | (top_p < 1.0)).nonzero().squeeze(1)
    if needs_sort.numel() > 0:
        sub, sub_k, sub_p = logits[needs_sort], top_k[needs_sort], top_p[needs_sort]
        limited_k = sub_k[sub_k < vocab_size]
        max_k = int(limited_k.max()) if limited_k.numel() > 0 else 0
        num_candidates = min(vocab_size, max(_NUM_TOP_P_CANDIDATES, max_k))
        removed, is_exact = _top_k_top_p_removed(sub, sub_k, sub_p, num_candidates)
        if not bool(is_exact.all()):
            inexact = (~is_exact).nonzero().squeeze(1)
            removed[inexact], _ = _top_k_top_p_removed(
                sub[inexact], sub_k[inexact], sub_p[inexact], vocab_size
            )
        logits = logits.index_copy(0, needs_sort, sub.masked_fill(removed, float("-inf")))
    if bool((min_p > 0).any()):
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p)  (same normaliser)
        max_logit = logits.max(-1, keepdim=True).values  # [S, 1]
        removed = logits < max_logit + min_p.log()[:, None]
        logits = logits.masked_fill(removed, float("-inf"))
    return logits


class Sampler:
    """Samples (and verifies drafts) for every row of a step in one batched call.

    Logprobs are fp32 log-softmax values of the distribution actually sampled from: after
    repetition penalty, temperature, top-k, top-p and min-p (removed tokens are -inf). For
    greedy rows they are the log-softmax of the penalised logits at temperature 1.

    Randomness: the token at output position i of a row is the inverse-CDF draw of
    `position_uniform(stream_seed, i)` (see `rejection_sampler`), so a seeded request's
    tokens do not depend on the batch, nor on drafting. Rows without a stream take a fresh
    one from the sampler's default stream, in row order. Greedy rows draw nothing.
    """

    def __init__(self, seed: int = 0) -> None:
        self._default_stream = random.Random(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        """logits: [sum(len(drafts_i) + 1), vocab]; row i owns len(drafts_i) + 1 consecutive
        logits rows; position j is the target's distribution for the token after draft j-1
        (j=0: after the last committed token)."""
        offsets = _row_offsets(rows)
        assert logits.dim() == 2 and logits.shape[0] == offsets[-1], (
            f"expected logits of shape [{offsets[-1]}, vocab], got {tuple(logits.shape)}"
        )
        vocab_size = logits.shape[1]
        for row in rows:
            assert all(0 <= d < vocab_size for d in row.draft_token_ids), (
                f"draft ids {row.draft_token_ids} outside the vocabulary of {vocab_size}"
            )
        logits = apply_repetition_penalty(logits.float(), rows, offsets)
        results: list[SampleResult | None] = [None] * len(rows)
        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if greedy:
            positions = [p for i in greedy for p in range(offsets[i], offsets[i + 1])]
            drafts = [rows[i].draft_token_ids for i in greedy]
            for i, result in zip(greedy, greedy_verify(select_rows(logits, positions), drafts)):
                results[i] = result
        if sampled:
            for i, result in zip(sampled, self._sample(logits, rows, offsets, sampled)):
                results[i] = result
        return results  # type: ignore[return-value]

    def _processed_logprobs(
        self, logits: torch.Tensor, rows: list[SamplingRow], offsets: list[int], row_ids: list[int]
    ) -> torch.Tensor:
        """Log-softmax after temperature and filters, for every position of `row_ids`."""
        positions, params = [], []
        for i in row_ids:
            positions.extend(range(offsets[i], offsets[i + 1]))
            params.extend([rows[i].params] * (offsets[i + 1] - offsets[i]))
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)  # [S]
        top_k = torch.tensor([p.top_k for p in params], device=device)  # [S]
        top_p = torch.tensor([p.top_p for p in params], device=device)  # [S]
        min_p = torch.tensor([p.min_p for p in params], device=device)  # [S]
        scaled = select_rows(logits, positions)  # [S, V]
        if bool((temperature != 1.0).any()):
            scaled = scaled / temperature[:, None]
        return filter_logits(scaled, top_k, top_p, min_p).log_softmax(-1)  # [S, V]

    def _uniforms(self, rows: list[SamplingRow], row_ids: list[int]) -> torch.Tensor:
        """One uniform per sampled position of `row_ids`, in order: [S] float64."""
        values = []
        for i in row_ids:
            row = rows[i]
            stream_seed = row.stream_seed
            if stream_seed is None:
                stream_seed = self._default_stream.getrandbits(64)
            first = row.first_output_index
            num_positions = len(row.draft_token_ids) + 1
            values.extend(position_uniform(stream_seed, first + j) for j in range(num_positions))
        return torch.tensor(values, dtype=torch.float64)

    def _sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], offsets: list[int], row_ids: list[int]
    ) -> list[SampleResult]:
        """Processed logprobs and each position's uniform, then verification."""
        logprobs = self._processed_logprobs(logits, rows, offsets, row_ids)  # [S, V]
        drafts = [rows[i].draft_token_ids for i in row_ids]
        return rejection_sample(logprobs, drafts, self._uniforms(rows, row_ids))
