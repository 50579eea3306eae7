"""Draft verification: greedy acceptance, and exact speculative sampling of point-mass drafts."""

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
    return _accept_matching_drafts(argmax.tolist(), logprobs.tolist(), drafts)


def rejection_sample(
    logprobs: torch.Tensor, drafts: list[list[int]], uniforms: torch.Tensor
) -> list[SampleResult]:
    """Speculative sampling of point-mass (n-gram) drafts, coupled to plain decoding.

    logprobs: [S, V], the processed (filtered, tempered) target distribution; row i owns
    len(drafts[i]) + 1 consecutive positions. uniforms: [S], one per position.

    Every position j draws its token x_j = inverse-CDF(p_j, u_j), and drafts are accepted
    while x_j == d_j; the row returns x_0 .. x_a, a being the first mismatch (or the bonus
    position). A draft d is a point mass q = delta_d, so the usual rule accepts it with
    probability min(1, p(d) / q(d)) = p(d) = P(x_j == d): the same acceptance rate, and every
    returned token is distributed exactly as p_j. Drawing x_j from position j's own uniform
    makes the tokens identical to those of decoding without drafts. Reported logprobs are
    log p_j(x_j) under the target.
    """
    token_ids = _inverse_cdf_sample(logprobs.exp(), uniforms.to(logprobs.device))  # [S]
    token_logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [S]
    return _accept_matching_drafts(token_ids.tolist(), token_logprobs.tolist(), drafts)


def _accept_matching_drafts(
    target_ids: list[int], target_logprobs: list[float], drafts: list[list[int]]
) -> list[SampleResult]:
    """Per row: the target's tokens up to and including the first that differs from its
    draft (all of them, the bonus included, when every draft matches)."""
    results, cursor = [], 0
    for row_drafts in drafts:
        row_ids = target_ids[cursor : cursor + len(row_drafts) + 1]
        num_accepted = _num_leading_true([x == d for x, d in zip(row_ids, row_drafts)])
        results.append(
            SampleResult(
                token_ids=row_ids[: num_accepted + 1],
                logprobs=target_logprobs[cursor : cursor + num_accepted + 1],
                num_accepted_drafts=num_accepted,
            )
        )
        cursor += len(row_drafts) + 1
    return results
