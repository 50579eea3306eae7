"""Scoring: the logprobs of given completions, through the same scheduler as generation.

A scored sequence is a request whose prompt is the whole sequence, asking for the logprobs of
its completion positions (`prompt_logprobs` from `prompt_len` on, so the prefix cache serves
the shared prompt of a GRPO group) and one token that is dropped. Torch-free: the server and
offline `LLM` share it.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout_engine.protocol import (
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    ScoreOutput,
)


def check_score_request(token_ids: Sequence[int], prompt_len: int) -> None:
    """InvalidRequestError unless `token_ids` has a prompt of `prompt_len` tokens and a
    completion of at least one."""
    if not isinstance(prompt_len, int) or not 1 <= prompt_len < len(token_ids):
        raise InvalidRequestError(
            f"prompt_len must be in [1, len(sequence) - 1] (a prompt and at least one completion "
            f"token); got {prompt_len!r} for a sequence of {len(token_ids)} tokens"
        )


def score_params(num_top: int | None) -> SamplingParams:
    """What a scored sequence asks of the engine: its prompt logprobs, one greedy token."""
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True,
                          prompt_logprobs=num_top or 0)


def score_output(output: RequestOutput, prompt_len: int, num_top: int | None) -> ScoreOutput:
    """The completion part of a finished scoring request's prompt logprobs."""
    entries = output.prompt_logprobs[prompt_len:]
    weight_version = output.outputs[0].weight_version if output.outputs else 0
    return ScoreOutput(
        logprobs=[entry.logprobs[0] for entry in entries],
        top_logprobs=list(entries) if num_top is not None else None,
        weight_version=weight_version,
    )
