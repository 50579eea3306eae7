"""Top-k, top-p and min-p on a batch of logits, with branches decided on the host.

One (partial) sort per batch: top-p first looks for its nucleus among a few most likely tokens
and falls back to a full sort only for rows whose nucleus reaches past them (or sorts the whole
vocabulary at once on a GPU, where the fallback's check would sync).

None of the filters can empty a row: top-k keeps its k-th token and every larger one, top-p
keeps the most likely token whatever `top_p` is, and min-p keeps every token at the maximum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Top-p first looks for its nucleus among this many most likely tokens (a partial sort),
# and falls back to a full sort only for rows whose nucleus reaches past them.
_NUM_TOP_P_CANDIDATES = 64


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
    # vLLM's rule: the nucleus always holds the most likely token, so no top_p (1e-50 is 0 in
    # float32) leaves a row without support.
    kept_sorted[:, 0] = True
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
