"""The errors a failed step raises: what went wrong, and which prompts it ended
(`request_ids`), so that the server hands each caller its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rollout_engine.protocol import (
    DeviceOutOfMemoryError,
    EngineError,
    GrammarDeadEndError,
    StepFailedError,
)

if TYPE_CHECKING:
    from rollout_engine.core.request import Request


def step_error(exc: BaseException, group_ids: Sequence[str]) -> BaseException:
    """The engine's error for a step that raised `exc` and ended the prompts `group_ids`:
    an EngineError as it is, a device OOM as DeviceOutOfMemoryError, any other Exception as
    StepFailedError; KeyboardInterrupt and other BaseExceptions as they are. Each carries
    `request_ids`."""
    if isinstance(exc, EngineError):
        error: BaseException = exc
    elif is_out_of_memory(exc):
        error = DeviceOutOfMemoryError(
            f"a step ran out of memory and its {len(group_ids)} prompts were ended: {exc}; "
            "free device memory (is the trainer still holding it?) and retry"
        )
    elif isinstance(exc, Exception):
        error = StepFailedError(
            f"a step failed and its {len(group_ids)} prompts were ended: "
            f"{type(exc).__name__}: {exc}"
        )
    else:
        error = exc
    error.request_ids = list(group_ids)  # type: ignore[attr-defined]
    return error


def dead_end_error(
    request: Request, group_ids: Sequence[str], vocab_size: int
) -> GrammarDeadEndError:
    """`request`'s constraint, or its token masks, allowed no token of the vocabulary, and
    the prompts `group_ids` were ended."""
    if request.grammar is None:  # allowed_token_ids, bad_words and min_tokens left nothing
        return GrammarDeadEndError(
            f"the sampling parameters of request {request.request_id!r} allow no token after "
            f"{request.num_output_tokens} output tokens (allowed_token_ids, bad_words and "
            f"min_tokens, which masks EOS and stop_token_ids, left nothing); "
            f"{len(group_ids)} prompt(s) were ended. Allow more tokens",
            request_ids=list(group_ids),
        )
    return GrammarDeadEndError(
        f"the structured-output constraint of request {request.request_id!r} allows no "
        f"token of the model's vocabulary (ids below {vocab_size}) after "
        f"{request.num_output_tokens} output tokens, so it cannot be continued; "
        f"{len(group_ids)} prompt(s) were ended. Change the constraint so that every "
        f"prefix it accepts can go on with a token the model has (a special token added to "
        f"the tokenizer past the vocabulary cannot be generated)",
        request_ids=list(group_ids),
    )


def stall_error(group_ids: Sequence[str]) -> StepFailedError:
    """No request could make progress (a bug): the prompts `group_ids` were ended rather than
    left waiting forever."""
    return StepFailedError(
        f"the scheduler made no progress on {len(group_ids)} prompts; they were ended",
        request_ids=list(group_ids),
    )


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or an allocator failure worded as one."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    message = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in message or "can't allocate memory" in message
    )
