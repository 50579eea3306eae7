"""Sampling masks: per returned token, the ids its processed distribution kept, for the rows
with `return_sampling_mask` (nothing is computed for the others).

A sampled position's support is where its distribution, after logits processing, temperature,
top-k, top-p and min-p, is not -inf: exactly the tokens its draw could have returned, at every
position of a row with drafts (each verified against its own distribution). A greedy
position's support is its argmax alone. The host plans which positions ask
(`plan_sampling_masks`), the device marks their supports (`sampled_support`), and the host
hands one int32 array of ids per returned token to each asking row (`attach_sampling_masks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from rollout_engine.worker.sampling.rejection_sampler import SampleResult
    from rollout_engine.worker.sampling.sampler import SamplingPlan


@dataclass
class SamplingMaskPlan:
    """Which positions of a sampling call return masks, known on the host before the call."""

    rows: list[bool]
    """Per row: it returns sampling masks."""
    sampled_index: list[int]
    """Per position: its index among the M sampled positions of asking rows; -1 for the others
    (greedy positions, whose mask is their token, and rows that do not ask)."""
    num_sampled: int
    """M."""


def plan_sampling_masks(
    plan: SamplingPlan, asks: np.ndarray, counts: np.ndarray, position_is_greedy: np.ndarray
) -> None:
    """Into `plan`: the masks' plan, and `mask_sampled_rows` (the asking positions' rows in
    the sampled part; absent when all of the part asks). `asks` [rows] bool, `counts` each
    row's positions, `position_is_greedy` [P]."""
    sampled = np.repeat(asks, counts) & ~position_is_greedy  # [P]
    index = np.where(sampled, np.cumsum(sampled) - 1, -1)
    num_sampled = int(sampled.sum())
    plan.sampling_masks = SamplingMaskPlan(asks.tolist(), index.tolist(), num_sampled)
    if 0 < num_sampled < plan.num_sampled:
        plan.arrays["mask_sampled_rows"] = (np.cumsum(~position_is_greedy) - 1)[sampled]


def sampled_support(distribution: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """[M, V] bool: the tokens the asking sampled positions' distributions keep. `distribution`
    [S, V] is the sampled part's processed log-softmax (-inf where a token was removed), `rows`
    the asking positions among S (None: all of them)."""
    if rows is not None:
        distribution = distribution.index_select(0, rows)
    return distribution.isfinite()


def attach_sampling_masks(
    results: list[SampleResult], support: torch.Tensor | None, plan: SamplingPlan
) -> None:
    """Per returned token of each asking row, its mask: the ids of its position's support
    (increasing), or for a greedy position its token. Costs one more copy from the device,
    after the call's results are on the host, and only when a sampled row asks."""
    mask_plan = plan.sampling_masks
    supports: list[np.ndarray] = []
    if support is not None:
        num_sampled = support.shape[0]
        counts = support.sum(-1)  # [M]
        token_ids = support.nonzero()[:, 1]  # [N], row-major: each row's ids increasing
        packed = torch.cat([counts, token_ids]).to(torch.int32).cpu().numpy()
        offsets = np.cumsum(packed[:num_sampled])[:-1]
        supports = np.split(packed[num_sampled:], offsets)
    cursor = 0
    for result, asks, drafts in zip(results, mask_plan.rows, plan.drafts):
        end = cursor + len(drafts) + 1
        if asks:  # the returned tokens are the row's first positions
            indexes = mask_plan.sampled_index[cursor:end]
            result.sampling_masks = [
                supports[index] if index >= 0 else np.array([token_id], dtype=np.int32)
                for token_id, index in zip(result.token_ids, indexes)
            ]
        cursor = end
