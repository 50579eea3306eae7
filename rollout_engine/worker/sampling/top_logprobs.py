"""The logprobs a sampling call reports: raw ones, and each asking position's rank and top-K.

A row reports its tokens' logprobs under the distribution they were sampled from, or with
`logprobs_mode="raw_logprobs"` under the model's raw `log_softmax(logits)`; with `logprobs=k`
each returned token also gets its rank in that same distribution and the k most likely tokens.
The host plans where each position's distribution comes from (`plan_top_logprobs`), the device
computes them (`reported_logprobs`), and the host hands them out per row (`attach_top_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rollout_engine.core.scheduler_output import NO_ALLOWED_TOKEN_ID
from rollout_engine.protocol import TopLogprobs

if TYPE_CHECKING:
    from rollout_engine.worker.sampling.rejection_sampler import SampleResult
    from rollout_engine.worker.sampling.sampler import SamplingPlan, SamplingRow

RAW_LOGPROBS = "raw_logprobs"


@dataclass
class PositionLogprobs:
    """A call's logprobs on the device, before its one copy to the host."""

    logprobs: torch.Tensor
    """[P] float32: each position's token under its row's reported distribution."""
    ranks: torch.Tensor | None = None
    """[L] int32, positions asking for top logprobs: 1 + tokens with a larger logprob."""
    top_token_ids: torch.Tensor | None = None
    """[L, K] int64: the K most likely tokens, most likely first."""
    top_logprobs: torch.Tensor | None = None
    """[L, K] float32: their logprobs."""
    sampling_support: torch.Tensor | None = None
    """[M, V] bool, the sampled positions of rows with `return_sampling_mask`: the tokens each
    one's distribution kept (`sampling_support`)."""


def plan_top_logprobs(
    plan: SamplingPlan, rows: list[SamplingRow], counts: np.ndarray,
    position_is_greedy: np.ndarray, vocab_size: int,
) -> None:
    """Top and raw logprobs' arrays and sizes, into `plan` (some row asks for either)."""
    num_rows = len(rows)
    num_top = np.fromiter(
        (-1 if row.params.logprobs is None else row.params.logprobs for row in rows),
        np.int64, num_rows,
    )
    is_raw = np.fromiter(
        (row.params.logprobs_mode == RAW_LOGPROBS for row in rows), bool, num_rows
    )
    plan.arrays |= _top_logprob_arrays(num_top, is_raw, counts, position_is_greedy)
    plan.num_raw_positions = int(counts[is_raw].sum())
    if (num_top >= 0).any():
        plan.num_top_logprobs = num_top.tolist()
        plan.max_top_logprobs = min(int(num_top.max()), vocab_size)
        plan.num_top_positions = int(counts[num_top >= 0].sum())


def _top_logprob_arrays(
    num_top: np.ndarray, is_raw: np.ndarray, counts: np.ndarray, position_is_greedy: np.ndarray
) -> dict[str, np.ndarray]:
    """Where each position's reported distribution comes from (only called when some row asks
    for top logprobs or reports raw ones). Per row: `num_top` its k (-1: none), `is_raw`
    whether it reports raw logprobs, `counts` its positions.

    - `greedy_top_dest`/`sampled_top_dest`: for the positions of the greedy / sampled part
      whose processed distribution gives top logprobs, their index among the L asking
      positions; `*_top_rows` their rows in the part (absent: the whole part, in order);
    - `raw_positions` [R]: positions of rows reporting raw logprobs (absent when R = 0 or
      R = P: `SamplingPlan.num_raw_positions` says which), `raw_top_rows` those of them that
      ask for top logprobs (indices into R; absent: all), `raw_top_dest` their index in L.
    """
    asks, raw = np.repeat(num_top >= 0, counts), np.repeat(is_raw, counts)  # [P]
    dest = np.cumsum(asks) - 1  # [P]: index among asking positions
    arrays = {}
    for part, in_part in (("greedy", position_is_greedy), ("sampled", ~position_is_greedy)):
        chosen = np.flatnonzero(asks & ~raw & in_part)
        if len(chosen):
            arrays[f"{part}_top_dest"] = dest[chosen]
            if len(chosen) < in_part.sum():
                arrays[f"{part}_top_rows"] = (np.cumsum(in_part) - 1)[chosen]
    raw_positions = np.flatnonzero(raw)
    if 0 < len(raw_positions) < len(raw):
        arrays["raw_positions"] = raw_positions
    chosen = np.flatnonzero(asks[raw_positions])
    if len(chosen):
        arrays["raw_top_dest"] = dest[raw_positions[chosen]]
        if len(chosen) < len(raw_positions):
            arrays["raw_top_rows"] = chosen
    return arrays


def reported_logprobs(
    raw_logits: torch.Tensor,
    parts: dict[str, tuple],
    token_ids: torch.Tensor,
    logprobs: torch.Tensor,
    plan: SamplingPlan,
    tensors: dict[str, torch.Tensor],
) -> PositionLogprobs:
    """Raw logprobs for the rows that report them, and the rank and top-K of every
    position that asks, each of the distribution its row reports. `parts`: per part
    ("greedy", "sampled") its (positions, token ids, logprobs, distribution [n, V])."""
    sources = []  # (distribution [n, V], token ids [n], index among asking positions [n])
    for part in ("greedy", "sampled"):
        if f"{part}_top_dest" in tensors:
            _, ids, _, distribution = parts[part]
            sources.append(_source(distribution, ids, tensors.get(f"{part}_top_rows"),
                                   tensors[f"{part}_top_dest"]))
    if plan.num_raw_positions:
        positions = tensors.get("raw_positions")  # None: every position
        raw_rows = raw_logits if positions is None else raw_logits.index_select(0, positions)
        distribution = raw_rows.log_softmax(-1)  # [R, V]
        ids = token_ids if positions is None else token_ids.index_select(0, positions)
        raw = distribution.gather(1, ids[:, None]).squeeze(1)  # [R]
        logprobs = raw if positions is None else logprobs.index_copy(0, positions, raw)
        if "raw_top_dest" in tensors:
            sources.append(_source(distribution, ids, tensors.get("raw_top_rows"),
                                   tensors["raw_top_dest"]))
    if not plan.num_top_positions:
        return PositionLogprobs(logprobs)
    num_top, k = plan.num_top_positions, plan.max_top_logprobs
    ranks = token_ids.new_empty(num_top, dtype=torch.int32)  # [L]
    top_ids = token_ids.new_empty(num_top, k)  # [L, K]
    top_logprobs = raw_logits.new_empty(num_top, k)  # [L, K]
    for distribution, ids, dest in sources:
        token_logprob = distribution.gather(1, ids[:, None])  # [n, 1]
        num_larger = (distribution > token_logprob).sum(-1, dtype=torch.int32)  # [n]
        ranks.index_copy_(0, dest, num_larger + 1)
        if k:
            values, indices = distribution.topk(k, dim=-1)  # [n, K], most likely first
            top_ids.index_copy_(0, dest, indices)
            top_logprobs.index_copy_(0, dest, values)
    return PositionLogprobs(logprobs, ranks, top_ids, top_logprobs)


def _source(
    distribution: torch.Tensor, token_ids: torch.Tensor, rows: torch.Tensor | None,
    dest: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of a part that give top logprobs (None: all of them, no copy)."""
    if rows is None:
        return distribution, token_ids, dest
    return distribution.index_select(0, rows), token_ids.index_select(0, rows), dest


def attach_top_logprobs(
    results: list[SampleResult], packed: torch.Tensor, plan: SamplingPlan
) -> None:
    """Per returned token of each asking row: the token first (its logprob and rank), then
    its row's k most likely tokens (ranks 1..k). `packed` holds ranks [L], then top ids
    [L, K], then top logprobs [L, K] (float64, on the host). A dead-ended position's entry is
    NO_ALLOWED_TOKEN_ID alone, logprob -inf, rank 0 (no token of the vocabulary)."""
    num_top, k_max = plan.num_top_positions, plan.max_top_logprobs
    ranks = packed[:num_top].long().tolist()
    top_ids = packed[num_top : num_top * (1 + k_max)].long().tolist()
    top_logprobs = packed[num_top * (1 + k_max) :].tolist()
    cursor = 0
    for result, k, drafts in zip(results, plan.num_top_logprobs, plan.drafts):
        if k < 0:
            continue
        k = min(k, k_max)
        entries = []
        for j, (token_id, logprob) in enumerate(zip(result.token_ids, result.logprobs)):
            if token_id == NO_ALLOWED_TOKEN_ID:
                entries.append(TopLogprobs([token_id], [logprob], [0]))
                continue
            begin = (cursor + j) * k_max
            entries.append(TopLogprobs(
                token_ids=[token_id] + top_ids[begin : begin + k],
                logprobs=[logprob] + top_logprobs[begin : begin + k],
                ranks=[ranks[cursor + j]] + list(range(1, k + 1)),
            ))
        result.top_logprobs = entries
        cursor += len(drafts) + 1
