"""Committing a step's sampled tokens to a request, cut at the first that ends it. No torch.

See DESIGN.md "The token ledger": a step yields the accepted drafts plus one token sampled by
the target model; they are appended one by one, and whatever follows a stop is dropped.
"""

from __future__ import annotations

from rollout_engine.core.request import Request
from rollout_engine.core.scheduler_output import NO_ALLOWED_TOKEN_ID
from rollout_engine.protocol import FinishReason, TopLogprobs


def append_sampled_tokens(
    request: Request,
    token_ids: list[int],
    logprobs: list[float] | None,
    top_logprobs: list[TopLogprobs] | None,
    *,
    weight_version: int,
    eos_token_ids: frozenset[int],
    max_model_len: int,
) -> FinishReason | None:
    """Commit tokens one by one, each recorded as sampled by `weight_version`, up to the first
    that ends the request (the rest, accepted drafts after a stop, are dropped). Returns why
    the request ends, if it does; ending it is the caller's."""
    for i, token_id in enumerate(token_ids):
        if token_id == NO_ALLOWED_TOKEN_ID:  # its grammar dead-ended: nothing to append
            request.is_dead_ended = True
            return "abort"
        request.append_output_token(token_id, logprobs[i] if logprobs else None,
                                    top_logprobs[i] if top_logprobs else None)
        request.record_weight_version(weight_version)
        reason = stop_reason(request, token_id, eos_token_ids, max_model_len)
        # A complete grammar allows only EOS: the request ends when it is sampled.
        if request.grammar is not None and not request.grammar.accept(token_id):
            reason = "abort"  # never sampled under its mask: a bug, not a hang
        if reason is not None:
            return reason
    return None


def stop_reason(
    request: Request, token_id: int, eos_token_ids: frozenset[int], max_model_len: int
) -> FinishReason | None:
    """Why `token_id`, just appended, ends the request, if it does. Before `min_tokens`
    tokens nothing but the length stops it (EOS and stop ids are masked there anyway).
    A stop token ends it before stop strings are looked for (vLLM's order: its text is
    not searched); the stop checker reads every other token (its text is the completion's).
    """
    params = request.sampling_params
    checker = request.stop_checker
    # A constrained request's stop token before min_tokens was let through by the sampler
    # because its grammar allowed nothing else (vLLM's rule: a complete `choice`): it ends.
    may_stop_on_token = (
        request.num_output_tokens >= params.min_tokens or request.grammar is not None
    )
    if may_stop_on_token and (
        token_id in params.stop_token_ids
        or (not params.ignore_eos and token_id in eos_token_ids)
    ):
        if token_id in params.stop_token_ids:
            request.stop_token_id = token_id
        request.ended_by_stop_token = True
        if checker is not None:
            checker.accept_stop_token(token_id)
        return "stop"
    if checker is not None and checker.accept(token_id):
        request.stop_str = checker.stop_string
        return "stop"
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return "length"
    return None
