"""Draft verification: greedy acceptance, and exact rejection sampling of point-mass drafts."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SampleResult:
    """What one row produced this step."""

    token_ids: list[int]
    """Accepted drafts + one token from the target (len = num_accepted_drafts + 1)."""
    logprobs: list[float]
    """fp32 logprob of each returned token under the target's processed distribution."""
    num_accepted_drafts: int


def select_rows(logits: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """logits[positions] for sorted unique positions, without a copy when that is all rows."""
    if len(positions) == logits.shape[0]:
        return logits
    return logits.index_select(0, torch.tensor(positions, device=logits.device))


def _num_leading_true(flags: list[bool]) -> int:
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)


def _inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample each row of unnormalised `probs` [R, V] with one uniform per row [R].

    The token is the first index whose cumulative mass exceeds u * total; zero-mass tokens
    never are (their cumulative mass equals their predecessor's). One random number per
    row, so a request's stream does not depend on the vocabulary size or the batch.
    """
    cdf = probs.double().cumsum(-1)  # [R, V]
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(1)  # [R, 1]
    token_ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return token_ids.clamp_(max=probs.shape[1] - 1)


def greedy_verify(logits: torch.Tensor, drafts: list[list[int]]) -> list[SampleResult]:
    """Accept drafts while they equal the target's argmax, then append its argmax.

    logits: [sum(len(d) + 1 for d in drafts), vocab]; row i owns len(drafts[i]) + 1
    consecutive positions. Logprobs are the log-softmax of `logits`.
    """
    argmax = logits.argmax(-1)  # [G]
    logprobs = logits.log_softmax(-1).gather(1, argmax[:, None]).squeeze(1)  # [G]
    argmax_ids, logprob_values = argmax.tolist(), logprobs.tolist()
    results, cursor = [], 0
    for row_drafts in drafts:
        targets = argmax_ids[cursor : cursor + len(row_drafts) + 1]
        num_accepted = _num_leading_true([t == d for t, d in zip(targets, row_drafts)])
        results.append(
            SampleResult(
                token_ids=targets[: num_accepted + 1],
                logprobs=logprob_values[cursor : cursor + num_accepted + 1],
                num_accepted_drafts=num_accepted,
            )
        )
        cursor += len(row_drafts) + 1
    return results


def rejection_sample(
    logprobs: torch.Tensor,
    drafts: list[list[int]],
    draft_uniforms: list[torch.Tensor],
    token_uniforms: torch.Tensor,
) -> list[SampleResult]:
    """Speculative sampling with point-mass (n-gram) drafts, then one token from the target.

    logprobs: [S, V], the processed (filtered, tempered) target distribution; row i owns
    len(drafts[i]) + 1 consecutive positions. draft_uniforms[i]: [len(drafts[i])];
    token_uniforms: [num_rows].

    Draft d at position j is a point mass q_j = delta_d, so the usual rule
        accept with probability min(1, p_j(d) / q_j(d)) = p_j(d)    (u ~ U(0,1), u < p_j(d))
        on rejection sample from norm(max(p_j - q_j, 0))  =  p_j with p_j[d] = 0, renormalised
    gives P(token = d) = p_j(d) and P(token = x != d) = (1 - p_j(d)) p_j(x) / (1 - p_j(d)),
    i.e. exactly p_j. All drafts accepted: a bonus token from p_k. Reported logprobs are
    log p_j(token) under the target, also for a token drawn from the residual.
    """
    starts, cursor = [], 0  # each row's first position within `logprobs`
    for row_drafts in drafts:
        starts.append(cursor)
        cursor += len(row_drafts) + 1
    num_accepted = _verify_drafts(logprobs, drafts, starts, draft_uniforms)

    final_positions, rejected_rows, rejected_ids = [], [], []
    for r, row_drafts in enumerate(drafts):
        final_positions.append(starts[r] + num_accepted[r])
        if num_accepted[r] < len(row_drafts):
            rejected_rows.append(r)
            rejected_ids.append(row_drafts[num_accepted[r]])
    device = logprobs.device
    probs = select_rows(logprobs, final_positions).exp()  # [R, V]
    rejected = (
        torch.tensor(rejected_rows, dtype=torch.long, device=device),
        torch.tensor(rejected_ids, dtype=torch.long, device=device),
    )
    probs[rejected] = 0.0  # the residual p_j with p_j[d] = 0
    token_ids = _inverse_cdf_sample(probs, token_uniforms.to(device))  # [R]
    final_positions_t = torch.tensor(final_positions, device=device)
    final_logprobs = logprobs[final_positions_t, token_ids].tolist()
    return _results(logprobs, drafts, starts, num_accepted, token_ids.tolist(), final_logprobs)


def _verify_drafts(
    logprobs: torch.Tensor,
    drafts: list[list[int]],
    starts: list[int],
    uniforms: list[torch.Tensor],
) -> list[int]:
    """Number of leading drafts accepted per row: u_j < p_j(d_j)."""
    positions, draft_ids = [], []
    for r, row_drafts in enumerate(drafts):
        positions.extend(range(starts[r], starts[r] + len(row_drafts)))
        draft_ids.extend(row_drafts)
    if not positions:
        return [0] * len(drafts)
    device = logprobs.device
    index = (torch.tensor(positions, device=device), torch.tensor(draft_ids, device=device))
    p_draft = logprobs[index].exp()  # [D]
    # u < 1 always, so p_j(d) = 1 is always accepted; and p_j(d) < 1 in fp32 means some
    # other token has p > 0: a rejection always leaves a non-empty residual.
    accepted = (torch.cat(uniforms).to(device) < p_draft).tolist()
    num_accepted, cursor = [], 0
    for row_drafts in drafts:
        num_accepted.append(_num_leading_true(accepted[cursor : cursor + len(row_drafts)]))
        cursor += len(row_drafts)
    return num_accepted


def _results(
    logprobs: torch.Tensor,
    drafts: list[list[int]],
    starts: list[int],
    num_accepted: list[int],
    final_ids: list[int],
    final_logprobs: list[float],
) -> list[SampleResult]:
    positions, draft_ids = [], []
    for r, row_drafts in enumerate(drafts):
        positions.extend(range(starts[r], starts[r] + num_accepted[r]))
        draft_ids.extend(row_drafts[: num_accepted[r]])
    accepted_logprobs: list[float] = []
    if positions:
        device = logprobs.device
        index = (torch.tensor(positions, device=device), torch.tensor(draft_ids, device=device))
        accepted_logprobs = logprobs[index].tolist()
    results, cursor = [], 0
    for r, row_drafts in enumerate(drafts):
        accepted = row_drafts[: num_accepted[r]]
        results.append(
            SampleResult(
                token_ids=accepted + [final_ids[r]],
                logprobs=accepted_logprobs[cursor : cursor + num_accepted[r]] + [final_logprobs[r]],
                num_accepted_drafts=num_accepted[r],
            )
        )
        cursor += num_accepted[r]
    return results
