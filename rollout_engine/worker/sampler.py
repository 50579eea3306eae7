"""Turns target logits into tokens: repetition penalty, temperature, filters, random draws.

Sampling is split in two so that a step waits for the device once: `Sampler.plan` runs on
the host before the forward and turns the rows' parameters into arrays (they travel to the
device with the step's inputs) and branch decisions (which would otherwise need a host
sync each); `Sampler.sample` then works on the device and brings back the tokens and
logprobs in one copy. Draft verification lives in `rejection_sampler`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from rollout_engine.core.scheduler_output import NO_ALLOWED_TOKEN_ID
from rollout_engine.protocol import SamplingParams
from rollout_engine.worker.ragged import index_within_runs
from rollout_engine.worker.rejection_sampler import (
    SampleResult,
    accept_matching_drafts,
    inverse_cdf_sample,
)

_MASK_64 = (1 << 64) - 1
_GOLDEN_GAMMA, _MIX_1, _MIX_2 = (
    np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
)
_SHIFT_11, _SHIFT_27, _SHIFT_30, _SHIFT_31 = (np.uint64(n) for n in (11, 27, 30, 31))
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


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """`_splitmix64` on a uint64 array (numpy's uint64 array arithmetic wraps mod 2**64)."""
    x = x + _GOLDEN_GAMMA
    x = (x ^ (x >> _SHIFT_30)) * _MIX_1
    x = (x ^ (x >> _SHIFT_27)) * _MIX_2
    return x ^ (x >> _SHIFT_31)


def position_uniforms(stream_seeds: np.ndarray, output_indices: np.ndarray) -> np.ndarray:
    """`position_uniform` for arrays of uint64 stream seeds and output indices: float64."""
    mixed = _splitmix64_array(stream_seeds ^ _splitmix64_array(output_indices.astype(np.uint64)))
    return (mixed >> _SHIFT_11).astype(np.float64) * 2.0**-53


def repetition_penalty_arrays(
    rows: list[SamplingRow], offsets: list[int], vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host side of the repetition penalty: (position, token) pairs of every token a
    penalised position has seen, and each position's penalty (1.0 = none).

    Position j of a row has seen the row's history and drafts[:j]. Ids >= vocab are ignored.
    """
    penalty = np.ones(offsets[-1], dtype=np.float32)
    seen_positions: list[np.ndarray] = []
    seen_tokens: list[np.ndarray] = []
    for i, row in enumerate(rows):
        if row.params.repetition_penalty == 1.0:
            continue
        start, end = offsets[i], offsets[i + 1]
        penalty[start:end] = row.params.repetition_penalty
        history = np.unique(np.asarray(row.token_history, dtype=np.int64))
        history = history[history < vocab_size]
        for j in range(end - start):
            tokens = np.concatenate([history, np.asarray(row.draft_token_ids[:j], np.int64)])
            seen_positions.append(np.full(len(tokens), start + j, dtype=np.int64))
            seen_tokens.append(tokens)
    empty = np.zeros(0, dtype=np.int64)
    return (
        np.concatenate(seen_positions) if seen_positions else empty,
        np.concatenate(seen_tokens) if seen_tokens else empty,
        penalty,
    )


def penalise(
    logits: torch.Tensor,
    seen_positions: torch.Tensor,
    seen_tokens: torch.Tensor,
    penalty: torch.Tensor,
) -> torch.Tensor:
    """Hugging Face's rule: a seen token's logit is divided by the penalty if > 0, else
    multiplied. logits [S, V]; seen_* [N] index pairs; penalty [S]."""
    seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    seen[seen_positions, seen_tokens] = True
    penalty = penalty[:, None]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_repetition_penalty(
    logits: torch.Tensor, rows: list[SamplingRow], offsets: list[int]
) -> torch.Tensor:
    """`penalise` with the pairs of `repetition_penalty_arrays` (rows own `offsets`)."""
    if all(row.params.repetition_penalty == 1.0 for row in rows):
        return logits
    arrays = repetition_penalty_arrays(rows, offsets, logits.shape[1])
    return penalise(logits, *(torch.from_numpy(a).to(logits.device) for a in arrays))


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[P, vocab_size] bool from a bitmask [P, W] int32 (W >= ceil(vocab_size / 32)), bit j of
    word w standing for token 32 * w + j; bits of ids >= vocab_size (tokens the tokenizer has
    and the model cannot emit) are dropped."""
    bits = torch.arange(32, device=device, dtype=torch.int32)
    allowed = (bitmask.to(device, torch.int32)[:, :, None] >> bits) & 1  # [P, W, 32]
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Tokens whose bit is 0 get -inf. logits [P, V]; bitmask [P, W] int32 (`allowed_tokens`)."""
    allowed = allowed_tokens(bitmask, logits.shape[1], logits.device)
    return logits.masked_fill(~allowed, float("-inf"))


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


@dataclass(frozen=True)
class FilterHints:
    """What the host already knows about a batch's filters, so filtering never asks the
    device (each question would be a host sync)."""

    sort_rows: torch.Tensor | None
    """[K] int64: rows with top-k or top-p on (on the logits' device); None when K = 0."""
    num_sort_rows: int
    max_k: int
    """The largest top-k below the vocabulary size among them (0 if none)."""
    any_top_p: bool
    any_min_p: bool
    exact_in_one_pass: bool
    """Sort top-p rows over the whole vocabulary at once instead of over candidates with a
    data-dependent fallback (the right trade on a GPU, where the fallback's check syncs)."""


@dataclass(frozen=True)
class FilterDecisions:
    """The filter branches of a batch, decided on the host from its per-row parameters."""

    top_k: np.ndarray
    """[S] int64, with "off" (< 1 or > vocab) written as the vocabulary size."""
    sort_rows: np.ndarray
    """[K] int64: rows with top-k or top-p on."""
    max_k: int
    """The largest top-k below the vocabulary size (0 if none)."""
    any_top_p: bool
    any_min_p: bool


def filter_decisions(
    top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray, vocab_size: int
) -> FilterDecisions:
    top_k = np.where((top_k < 1) | (top_k > vocab_size), vocab_size, top_k)
    limited_k = top_k[top_k < vocab_size]
    return FilterDecisions(
        top_k=top_k,
        sort_rows=np.flatnonzero((top_k < vocab_size) | (top_p < 1.0)),
        max_k=int(limited_k.max()) if len(limited_k) else 0,
        any_top_p=bool((top_p < 1.0).any()),
        any_min_p=bool((min_p > 0).any()),
    )


def filter_hints(
    top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, vocab_size: int
) -> FilterHints:
    """Hints read from the tensors themselves (host syncs; fine on the CPU and in tests)."""
    decisions = filter_decisions(
        top_k.cpu().numpy(), top_p.cpu().numpy(), min_p.cpu().numpy(), vocab_size
    )
    return FilterHints(
        sort_rows=torch.from_numpy(decisions.sort_rows).to(top_k.device),
        num_sort_rows=len(decisions.sort_rows),
        max_k=decisions.max_k,
        any_top_p=decisions.any_top_p,
        any_min_p=decisions.any_min_p,
        exact_in_one_pass=top_k.is_cuda,
    )


def filter_logits(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    hints: FilterHints | None = None,
) -> torch.Tensor:
    """Top-k, then top-p, then min-p; removed tokens get -inf. One (partial) sort per batch.

    Without `hints` they are read from the tensors (which syncs on a GPU). With them, a
    parameter the hints say is off everywhere may be None.
    """
    # logits [S, V] (temperature already applied); top_k [S] (-1 = off); top_p, min_p [S]
    vocab_size = logits.shape[1]
    if hints is None:
        hints = filter_hints(top_k, top_p, min_p, vocab_size)
    if hints.num_sort_rows > 0:
        top_k = torch.where((top_k < 1) | (top_k > vocab_size), vocab_size, top_k)
        rows = hints.sort_rows
        sub, sub_k, sub_p = logits[rows], top_k[rows], top_p[rows]
        num_candidates = min(vocab_size, max(_NUM_TOP_P_CANDIDATES, hints.max_k))
        if hints.any_top_p and hints.exact_in_one_pass:
            num_candidates = vocab_size
        removed, is_exact = _top_k_top_p_removed(sub, sub_k, sub_p, num_candidates)
        if num_candidates < vocab_size and not bool(is_exact.all()):
            inexact = (~is_exact).nonzero().squeeze(1)
            removed[inexact], _ = _top_k_top_p_removed(
                sub[inexact], sub_k[inexact], sub_p[inexact], vocab_size
            )
        logits = logits.index_copy(0, rows, sub.masked_fill(removed, float("-inf")))
    if hints.any_min_p:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p)  (same normaliser)
        max_logit = logits.max(-1, keepdim=True).values  # [S, 1]
        removed = logits < max_logit + min_p.log()[:, None]
        logits = logits.masked_fill(removed, float("-inf"))
    return logits


@dataclass
class SamplingPlan:
    """A sampling call as the host sees it before any logits exist.

    `arrays` hold one entry per sampled position (greedy and sampled positions apart);
    the flags decide the branches `Sampler.sample` takes without asking the device.
    """

    drafts: list[list[int]]
    """Each row's drafts; row i owns len(drafts[i]) + 1 consecutive logits rows."""
    num_positions: int
    num_greedy: int
    num_sampled: int
    any_penalty: bool
    any_temperature: bool
    num_sort_rows: int
    max_k: int
    any_top_p: bool
    any_min_p: bool
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


class Sampler:
    """Samples (and verifies drafts) for every row of a step in one batched call.

    Logprobs are fp32 log-softmax values of the distribution actually sampled from: after
    repetition penalty, temperature, top-k, top-p and min-p (removed tokens are -inf). For
    greedy rows they are the log-softmax of the penalised logits at temperature 1.

    Randomness: the token at output position i of a row is the inverse-CDF draw of
    `position_uniform(stream_seed, i)` (see `rejection_sampler`), so a seeded request's
    tokens do not depend on the batch, nor on drafting. Rows without a stream take a fresh
    one from the sampler's default stream, in row order. Greedy rows draw nothing.

    `exact_in_one_pass` (default: on for GPUs) sorts top-p rows over the whole vocabulary
    instead of a partial sort with a fallback whose check would sync; the tokens are the same.
    """

    def __init__(self, seed: int = 0, exact_in_one_pass: bool | None = None) -> None:
        self._default_stream = random.Random(seed)
        self.exact_in_one_pass = exact_in_one_pass

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        """logits: [sum(len(drafts_i) + 1), vocab]; row i owns len(drafts_i) + 1 consecutive
        logits rows; position j is the target's distribution for the token after draft j-1
        (j=0: after the last committed token)."""
        plan = self.plan(rows, logits.shape[1])
        tensors = {name: torch.from_numpy(a).to(logits.device) for name, a in plan.arrays.items()}
        return self.sample(logits, plan, tensors)

    def plan(self, rows: list[SamplingRow], vocab_size: int) -> SamplingPlan:
        """Host work of a call: per-position parameters, uniforms and branch decisions.

        One Python pass over the rows, numpy per position. Draws the default stream's seeds,
        so call it once per call, in step order.
        """
        num_rows = len(rows)
        num_drafts = np.fromiter((len(row.draft_token_ids) for row in rows), np.int64, num_rows)
        for row, count in zip(rows, num_drafts):
            if count:
                assert all(0 <= d < vocab_size for d in row.draft_token_ids), (
                    f"draft ids {row.draft_token_ids} outside the vocabulary of {vocab_size}"
                )
        columns = [
            (p.temperature, p.top_k, p.top_p, p.min_p, p.is_greedy, p.repetition_penalty != 1.0)
            for p in (row.params for row in rows)
        ]
        temperature, top_k, top_p, min_p, greedy, penalised = (
            np.array(column, dtype=dtype).reshape(num_rows)
            for column, dtype in zip(
                zip(*columns) if columns else [()] * 6,
                (np.float32, np.int64, np.float32, np.float32, bool, bool),
            )
        )
        # Each sampled row's stream: its own, else a fresh one from the default stream.
        draw = self._default_stream.getrandbits
        stream_seeds = np.array(
            [0 if g else (row.stream_seed if row.stream_seed is not None else draw(64))
             for row, g in zip(rows, greedy.tolist())],
            dtype=np.uint64,
        ).reshape(num_rows)
        first_index = np.fromiter((row.first_output_index for row in rows), np.int64, num_rows)

        # Per position: row i owns num_drafts[i] + 1 consecutive positions.
        counts = num_drafts + 1
        row_of_position = np.repeat(np.arange(num_rows), counts)
        offset_in_row = index_within_runs(counts)
        position_is_greedy = greedy[row_of_position]
        sampled_positions = np.flatnonzero(~position_is_greedy)
        sampled_rows = row_of_position[sampled_positions]
        filters = filter_decisions(
            top_k[sampled_rows], top_p[sampled_rows], min_p[sampled_rows], vocab_size
        )
        temperature = temperature[sampled_rows]
        uniforms = position_uniforms(
            stream_seeds[sampled_rows],
            first_index[sampled_rows] + offset_in_row[sampled_positions],
        )
        any_penalty = bool(penalised.any())
        plan = SamplingPlan(
            drafts=[row.draft_token_ids for row in rows],
            num_positions=len(row_of_position),
            num_greedy=len(row_of_position) - len(sampled_positions),
            num_sampled=len(sampled_positions),
            any_penalty=any_penalty,
            any_temperature=bool((temperature != 1.0).any()),
            num_sort_rows=len(filters.sort_rows),
            max_k=filters.max_k,
            any_top_p=filters.any_top_p,
            any_min_p=filters.any_min_p,
        )
        # Only what `sample` will read: fewer arrays, less to pack and move.
        arrays = plan.arrays
        if plan.num_greedy and plan.num_sampled:
            arrays["greedy_positions"] = np.flatnonzero(position_is_greedy)
            arrays["sampled_positions"] = sampled_positions
        if plan.num_sampled:
            arrays["uniforms"] = uniforms
        if plan.any_temperature:
            arrays["temperature"] = temperature
        if plan.num_sort_rows:
            arrays |= {"sort_rows": filters.sort_rows, "top_k": filters.top_k,
                       "top_p": top_p[sampled_rows]}
        if plan.any_min_p:
            arrays["min_p"] = min_p[sampled_rows]
        if any_penalty:
            offsets = np.zeros(num_rows + 1, dtype=np.int64)
            np.cumsum(counts, out=offsets[1:])
            seen_positions, seen_tokens, penalty = repetition_penalty_arrays(
                rows, offsets.tolist(), vocab_size
            )
            plan.arrays |= {
                "seen_positions": seen_positions, "seen_tokens": seen_tokens, "penalty": penalty
            }
        return plan

    def sample(
        self, logits: torch.Tensor, plan: SamplingPlan, tensors: dict[str, torch.Tensor]
    ) -> list[SampleResult]:
        """Device work of a call; `tensors` are `plan.arrays` on the logits' device.

        The only host sync is the final copy of the tokens and their logprobs.
        """
        return self.to_results(*self.sample_positions(logits, plan, tensors), plan)

    @staticmethod
    def to_results(
        token_ids: torch.Tensor, logprobs: torch.Tensor, plan: SamplingPlan
    ) -> list[SampleResult]:
        """Bring a call's tokens and logprobs to the host (its one sync); accept drafts."""
        # Token ids are exact in float64.
        on_host = torch.stack((token_ids.double(), logprobs.double())).cpu()
        return accept_matching_drafts(
            on_host[0].long().tolist(), on_host[1].tolist(), plan.drafts
        )

    def sample_positions(
        self,
        logits: torch.Tensor,
        plan: SamplingPlan,
        tensors: dict[str, torch.Tensor],
        token_bitmask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's token and its logprob at every position, on the device, no sync:
        [num_positions] int64 and float32 (row i's positions are consecutive).

        `token_bitmask` ([num_positions, >= ceil(vocab / 32)] int32, structured outputs)
        removes the tokens a grammar forbids before anything else, so logprobs are those of the
        constrained distribution. A position whose mask allows no token of the vocabulary (the
        grammar dead-ended) yields NO_ALLOWED_TOKEN_ID with logprob -inf: never a token."""
        assert logits.dim() == 2 and logits.shape[0] == plan.num_positions, (
            f"expected logits of shape [{plan.num_positions}, vocab], got {tuple(logits.shape)}"
        )
        logits = logits.float()
        no_token = None
        if token_bitmask is not None:
            allowed = allowed_tokens(token_bitmask, logits.shape[1], logits.device)  # [P, V]
            no_token = ~allowed.any(-1)  # [P]
            # A dead-ended row stays unmasked: all -inf would put NaNs through the softmax,
            # and its result is replaced below anyway.
            logits = logits.masked_fill(~allowed & ~no_token[:, None], float("-inf"))
        if plan.any_penalty:
            logits = penalise(
                logits, tensors["seen_positions"], tensors["seen_tokens"], tensors["penalty"]
            )
        parts = []  # (positions or None for all, token ids, logprobs)
        if plan.num_greedy:
            greedy = self._rows(logits, tensors.get("greedy_positions"), plan.num_greedy)
            token_ids = greedy.argmax(-1)  # [G]
            logprobs = greedy.log_softmax(-1).gather(1, token_ids[:, None]).squeeze(1)
            parts.append((tensors.get("greedy_positions"), token_ids, logprobs))
        if plan.num_sampled:
            logprobs = self._processed_logprobs(logits, plan, tensors)  # [S, V]
            token_ids = inverse_cdf_sample(logprobs.exp(), tensors["uniforms"])  # [S]
            parts.append((tensors.get("sampled_positions"), token_ids,
                          logprobs.gather(1, token_ids[:, None]).squeeze(1)))
        if len(parts) == 1:
            token_ids, logprobs = parts[0][1], parts[0][2]
        else:
            token_ids = logits.new_empty(plan.num_positions, dtype=torch.int64)
            logprobs = logits.new_empty(plan.num_positions)
            for positions, ids, lps in parts:
                token_ids.index_copy_(0, positions, ids)
                logprobs.index_copy_(0, positions, lps)
        if no_token is not None:
            token_ids = token_ids.masked_fill(no_token, NO_ALLOWED_TOKEN_ID)
            logprobs = logprobs.masked_fill(no_token, float("-inf"))
        return token_ids, logprobs

    @staticmethod
    def _rows(
        logits: torch.Tensor, positions: torch.Tensor | None, count: int
    ) -> torch.Tensor:
        return logits if count == logits.shape[0] else logits.index_select(0, positions)

    def _processed_logprobs(
        self, logits: torch.Tensor, plan: SamplingPlan, tensors: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Log-softmax after temperature and filters, for every sampled position: [S, V]."""
        scaled = self._rows(logits, tensors.get("sampled_positions"), plan.num_sampled)
        if plan.any_temperature:
            scaled = scaled / tensors["temperature"][:, None]
        if not (plan.num_sort_rows or plan.any_min_p):
            return scaled.log_softmax(-1)
        exact_in_one_pass = self.exact_in_one_pass
        if exact_in_one_pass is None:
            exact_in_one_pass = logits.is_cuda
        hints = FilterHints(
            sort_rows=tensors.get("sort_rows"),
            num_sort_rows=plan.num_sort_rows,
            max_k=plan.max_k,
            any_top_p=plan.any_top_p,
            any_min_p=plan.any_min_p,
            exact_in_one_pass=exact_in_one_pass,
        )
        filtered = filter_logits(
            scaled, tensors.get("top_k"), tensors.get("top_p"), tensors.get("min_p"), hints
        )
        return filtered.log_softmax(-1)
