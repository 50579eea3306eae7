"""Logprobs of prompt positions (`SamplingParams.prompt_logprobs`, scoring), chunk by chunk.

The hidden state at position p predicts the token at p + 1: a prompt chunk covering positions
[s, s + n) yields the logprobs of prompt positions s + 1 .. s + n (those still in the prompt and
asked for). They are computed from the model's raw logits a slice of rows at a time, so a long
prompt never holds [prompt_len, vocab] logits at once, and brought to the host in one copy per
slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rollout_engine.protocol import TopLogprobs
from rollout_engine.worker.persistent_batch import StepRequest

MAX_LOGITS_ELEMENTS = 1 << 25
"""Rows of logits per slice: at most this many fp32 values (128 MiB) at once."""


@dataclass(frozen=True)
class PromptLogprobsJob:
    """One request's prompt positions in this step."""

    request_id: str
    first_position: int
    """The prompt position of the first entry (the token its row predicts)."""
    rows: np.ndarray
    """[R] int64: rows of the step's flat batch whose hidden states predict them."""
    target_ids: np.ndarray
    """[R] int64: the prompt's tokens at those positions."""
    num_top: int


def prompt_logprobs_jobs(
    scheduled: Sequence[StepRequest], query_start_loc: np.ndarray
) -> list[PromptLogprobsJob]:
    """The step's prompt-logprob work: for each request asking, the positions its query covers
    that predict prompt tokens at or after its `prompt_logprobs_start`."""
    jobs = []
    for i, req in enumerate(scheduled):
        if not req.prompt_logprobs_start:
            continue
        first = max(req.start_position + 1, req.prompt_logprobs_start)  # predicted positions
        end = min(req.start_position + len(req.input_token_ids), req.num_prompt_tokens - 1) + 1
        if first >= end:
            continue
        rows = query_start_loc[i] + np.arange(first - 1, end - 1) - req.start_position
        targets = np.asarray(req.token_ids[first:end], dtype=np.int64)
        jobs.append(PromptLogprobsJob(req.request_id, first, rows.astype(np.int64), targets,
                                      req.sampling_params.prompt_logprobs or 0))
    return jobs


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    jobs: Sequence[PromptLogprobsJob],
    vocab_size: int,
) -> dict[str, tuple[int, list[TopLogprobs]]]:
    """Per job (first position, one entry per position): the prompt token's logprob and rank
    first, then the `num_top` most likely tokens, from `log_softmax` of the raw logits.
    hidden: [T, hidden] of the whole step; `compute_logits` ([R, hidden] -> [R, V] fp32) is
    called the same number of times with the same shapes on every tensor-parallel rank."""
    results = {}
    rows_per_slice = max(1, MAX_LOGITS_ELEMENTS // vocab_size)
    for job in jobs:
        entries: list[TopLogprobs] = []
        rows = torch.from_numpy(job.rows).to(hidden.device)
        targets = torch.from_numpy(job.target_ids).to(hidden.device)
        for begin in range(0, len(rows), rows_per_slice):
            end = begin + rows_per_slice
            entries += _slice_entries(
                compute_logits(hidden.index_select(0, rows[begin:end])), targets[begin:end],
                job.num_top,
            )
        results[job.request_id] = (job.first_position, entries)
    return results


def _slice_entries(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> list[TopLogprobs]:
    logprobs = logits.float().log_softmax(-1)  # [R, V]
    target_logprobs = logprobs.gather(1, targets[:, None])  # [R, 1]
    ranks = (logprobs > target_logprobs).sum(-1, keepdim=True) + 1  # [R, 1]
    columns = [targets[:, None].double(), target_logprobs.double(), ranks.double()]
    if num_top:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # [R, k], most likely first
        columns += [top_ids.double(), top_logprobs.double()]
    on_host = torch.cat(columns, dim=1).cpu().numpy()  # one copy: ids exact in float64
    top_ranks = list(range(1, num_top + 1))
    entries = []
    for row in on_host:
        token_ids = [int(row[0])] + row[3 : 3 + num_top].astype(np.int64).tolist()
        values = [float(row[1])] + row[3 + num_top :].tolist()
        entries.append(TopLogprobs(token_ids, values, [int(row[2])] + top_ranks))
    return entries
