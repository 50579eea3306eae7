"""Logits processing before temperature: token masks, logit bias and penalties.

Per sampled position, in this order (greedy and sampled rows alike):

1. Masks, each setting the logits of the tokens it forbids to -inf: the structured-outputs
   bitmask, `allowed_token_ids` (every other token), `bad_words` (vLLM's rule: a one-token
   word always; a longer word's last token where the output ends with its other tokens) and
   `min_tokens` (EOS, unless `ignore_eos`, and `stop_token_ids` while the position's output
   index is below `min_tokens`; for a constrained row, not where the other masks allow only
   stop tokens: vLLM's rule, so a complete grammar still ends with its EOS). A position
   whose masks leave no token is a dead end: the sampler answers NO_ALLOWED_TOKEN_ID there
   (its logits are left unmasked, so nothing downstream sees a row of -inf and makes NaNs).
2. `logit_bias` is added.
3. Penalties: repetition (Hugging Face's rule over prompt + output), then frequency
   (`logit -= frequency_penalty * count`) and presence (`logit -= presence_penalty` if
   count > 0), OpenAI's rule, the counts taken over the output only.

Position j of a row with drafts has seen the row's output and drafts[:j] (the counts, the
bad words' prefixes and the output index all include the earlier drafts), so a drafting
step processes every position as plain decoding would. Ids >= the vocabulary size are
ignored (refusing them is the engine's job).

`processing_arrays` turns the rows' parameters into sparse (position, token) arrays on the
host, with work proportional to what the rows use; `process_logits` applies them on the
device without a host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from rollout_engine.protocol import SamplingParams
    from rollout_engine.worker.sampling.sampler import SamplingRow


@dataclass(frozen=True)
class LogitsProcessing:
    """Which processing steps a batch uses, decided on the host (each is off when no row's
    parameters change a logit)."""

    any_mask: bool = False
    """`allowed_token_ids`, `bad_words` or `min_tokens` masks a token somewhere."""
    any_logit_bias: bool = False
    any_repetition_penalty: bool = False
    any_output_penalty: bool = False
    """Presence or frequency penalty."""


def needs_history(params: SamplingParams, bad_words_token_ids: list[list[int]]) -> bool:
    """Whether a row's processing reads its tokens (`SamplingRow.token_history` must hold
    prompt + output): repetition penalty, presence or frequency penalty, or a bad word of
    more than one token."""
    return (
        params.repetition_penalty != 1.0
        or params.any_output_penalty
        or bool(bad_words_token_ids and any(len(w) > 1 for w in bad_words_token_ids))
    )


class _Pairs:
    """(position, token[, value]) entries collected row by row."""

    def __init__(self) -> None:
        self.positions: list[np.ndarray] = []
        self.tokens: list[np.ndarray] = []
        self.values: list[np.ndarray] = []

    def add(
        self, positions: np.ndarray, tokens: np.ndarray, values: np.ndarray | None = None
    ) -> None:
        self.positions.append(positions)
        self.tokens.append(tokens)
        if values is not None:
            self.values.append(values)

    def add_at(self, position: int, tokens: np.ndarray) -> None:
        self.add(np.full(len(tokens), position, dtype=np.int64), tokens)

    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        if not self.positions or not sum(len(p) for p in self.positions):
            return {}
        arrays = {
            f"{prefix}_positions": np.concatenate(self.positions).astype(np.int64, copy=False),
            f"{prefix}_tokens": np.concatenate(self.tokens).astype(np.int64, copy=False),
        }
        if self.values:
            arrays[f"{prefix}_values"] = np.concatenate(self.values).astype(np.float32)
        return arrays


def _token_ids(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """Distinct ids below the vocabulary size, sorted: int64."""
    array = np.unique(np.asarray(ids, dtype=np.int64))
    return array[(array >= 0) & (array < vocab_size)]


def _check_history(row: SamplingRow) -> None:
    """The history must hold the whole committed output (and no more) when it is read."""
    num_outputs = len(row.token_history) - row.num_prompt_tokens
    assert num_outputs == row.first_output_index, (
        f"token_history holds {num_outputs} output tokens but the row samples output index "
        f"{row.first_output_index}: a row whose processing reads its output must be sampled "
        "with all of its output on the host (no step scheduled ahead of an output in flight)"
    )


def _add_allowed(
    row: SamplingRow, positions: np.ndarray, vocab_size: int,
    restricted: list[np.ndarray], allowed: _Pairs,
) -> None:
    ids = _token_ids(row.params.allowed_token_ids, vocab_size)
    restricted.append(positions)
    allowed.add(np.repeat(positions, len(ids)), np.tile(ids, len(positions)))


def _add_bad_words(
    row: SamplingRow, positions: np.ndarray, vocab_size: int, banned: _Pairs
) -> None:
    words = [list(w) for w in row.bad_words_token_ids if w and 0 <= w[-1] < vocab_size]
    single = _token_ids([w[-1] for w in words if len(w) == 1], vocab_size)
    if len(single):
        banned.add(np.repeat(positions, len(single)), np.tile(single, len(positions)))
    longer = [w for w in words if len(w) > 1]
    if not longer:
        return
    # Only the output's last (longest prefix) tokens matter; drafts follow them.
    num_tail = max(len(w) for w in longer) - 1
    _check_history(row)
    history, first = row.token_history, row.num_prompt_tokens
    tail = history[max(first, len(history) - num_tail) :]
    seen = list(tail) + list(row.draft_token_ids)
    for j, position in enumerate(positions.tolist()):
        end = len(tail) + j  # position j has seen tail + drafts[:j]
        last = [
            w[-1] for w in longer if len(w) - 1 <= end and seen[end - len(w) + 1 : end] == w[:-1]
        ]
        if last:
            banned.add_at(position, np.asarray(last, dtype=np.int64))


def _add_min_tokens(
    row: SamplingRow, positions: np.ndarray, vocab_size: int,
    eos_token_ids: Sequence[int], stop_banned: _Pairs, yielding: list[np.ndarray],
) -> None:
    params = row.params
    stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
    stop_ids = _token_ids(stop_ids, vocab_size)
    num_masked = min(len(positions), params.min_tokens - row.first_output_index)
    if len(stop_ids) and num_masked > 0:
        masked = positions[:num_masked]
        stop_banned.add(np.repeat(masked, len(stop_ids)), np.tile(stop_ids, num_masked))
        if params.structured_outputs is not None:
            yielding.append(masked)


def _add_logit_bias(
    row: SamplingRow, positions: np.ndarray, vocab_size: int, bias: _Pairs
) -> None:
    items = [(t, b) for t, b in row.params.logit_bias.items() if 0 <= t < vocab_size]
    if not items:
        return
    tokens = np.fromiter((t for t, _ in items), np.int64, len(items))
    values = np.fromiter((b for _, b in items), np.float64, len(items))
    n = len(positions)
    bias.add(np.repeat(positions, len(items)), np.tile(tokens, n), np.tile(values, n))


class _OutputPenalty:
    """Presence and frequency penalties: every (position, token) pair of the tokens a
    position's output holds, counted in one sort for the whole batch."""

    def __init__(self, vocab_size: int, num_positions: int) -> None:
        self.vocab_size = vocab_size
        self.keys: list[np.ndarray] = []  # position * vocab_size + token, once per occurrence
        self.frequency = np.zeros(num_positions)
        self.presence = np.zeros(num_positions)

    def add(self, row: SamplingRow, positions: np.ndarray) -> None:
        _check_history(row)
        output = np.asarray(row.token_history[row.num_prompt_tokens :], dtype=np.int64)
        output = output[(output >= 0) & (output < self.vocab_size)]
        seen = np.concatenate([output, np.asarray(row.draft_token_ids, dtype=np.int64)])
        for j, position in enumerate(positions.tolist()):  # j has seen output + drafts[:j]
            self.keys.append(position * self.vocab_size + seen[: len(output) + j])
        self.frequency[positions] = row.params.frequency_penalty
        self.presence[positions] = row.params.presence_penalty

    def arrays(self) -> dict[str, np.ndarray]:
        keys = np.concatenate(self.keys) if self.keys else np.zeros(0, dtype=np.int64)
        if not len(keys):
            return {}
        keys, counts = np.unique(keys, return_counts=True)
        positions, tokens = np.divmod(keys, self.vocab_size)
        values = -(self.frequency[positions] * counts + self.presence[positions])
        return {"output_penalty_positions": positions, "output_penalty_tokens": tokens,
                "output_penalty_values": values.astype(np.float32)}


def _add_repetition(
    row: SamplingRow, positions: np.ndarray, vocab_size: int, seen: _Pairs,
    penalty: np.ndarray,
) -> None:
    penalty[positions] = row.params.repetition_penalty
    history = np.unique(np.asarray(row.token_history, dtype=np.int64))
    history = history[history < vocab_size]
    for j, position in enumerate(positions.tolist()):
        seen.add_at(position, np.concatenate(
            [history, np.asarray(row.draft_token_ids[:j], np.int64)]
        ))


def repetition_penalty_arrays(
    rows: list[SamplingRow], offsets: list[int], vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host side of the repetition penalty: (position, token) pairs of every token a
    penalised position has seen, and each position's penalty (1.0 = none).

    Position j of a row has seen the row's history and drafts[:j]. Ids >= vocab are ignored.
    """
    penalty = np.ones(offsets[-1], dtype=np.float32)
    seen = _Pairs()
    for i, row in enumerate(rows):
        if row.params.repetition_penalty != 1.0:
            positions = np.arange(offsets[i], offsets[i + 1], dtype=np.int64)
            _add_repetition(row, positions, vocab_size, seen, penalty)
    arrays = seen.arrays("seen")
    empty = np.zeros(0, dtype=np.int64)
    return arrays.get("seen_positions", empty), arrays.get("seen_tokens", empty), penalty


def processing_arrays(
    rows: list[SamplingRow],
    spans: list[tuple[int, int]],
    vocab_size: int,
    eos_token_ids: Sequence[int],
    num_positions: int,
) -> tuple[LogitsProcessing, dict[str, np.ndarray]]:
    """The steps a batch uses and their host arrays. `rows` are the rows that use any
    (others cost nothing), row i owning positions [spans[i][0], spans[i][1]) of the
    `num_positions`. Arrays hold only what is used:

    - masks: `restricted_positions` [A] (rows with `allowed_token_ids`), whose
      `allowed_positions`/`allowed_tokens` [N] pairs stay; `banned_positions`/`banned_tokens`
      [N] pairs (bad words); `stop_banned_positions`/`stop_banned_tokens` [N] pairs
      (min_tokens), lifted at the `yielding_positions` [Y] (constrained rows) where the other
      masks leave nothing else.
    - `bias_positions`/`bias_tokens`/`bias_values` [N] (float32, added).
    - `seen_positions`/`seen_tokens` [N] and `penalty` [P] (repetition).
    - `output_penalty_positions`/`output_penalty_tokens`/`output_penalty_values` [N]
      (float32, added: -(frequency * count + presence)).
    """
    restricted: list[np.ndarray] = []
    yielding: list[np.ndarray] = []
    allowed, banned, stop_banned = _Pairs(), _Pairs(), _Pairs()
    bias, seen = _Pairs(), _Pairs()
    output_penalty = _OutputPenalty(vocab_size, num_positions)
    penalty = None
    for row, (start, end) in zip(rows, spans):
        params = row.params
        positions = np.arange(start, end, dtype=np.int64)
        if params.allowed_token_ids is not None:
            _add_allowed(row, positions, vocab_size, restricted, allowed)
        if row.bad_words_token_ids:
            _add_bad_words(row, positions, vocab_size, banned)
        if params.min_tokens > row.first_output_index:
            _add_min_tokens(row, positions, vocab_size, eos_token_ids, stop_banned, yielding)
        if params.logit_bias:
            _add_logit_bias(row, positions, vocab_size, bias)
        if params.repetition_penalty != 1.0:
            if penalty is None:
                penalty = np.ones(num_positions, dtype=np.float32)
            _add_repetition(row, positions, vocab_size, seen, penalty)
        if params.any_output_penalty:
            output_penalty.add(row, positions)
    arrays = allowed.arrays("allowed") | banned.arrays("banned") | stop_banned.arrays("stop_banned")
    if restricted:
        arrays["restricted_positions"] = np.concatenate(restricted)
    if yielding:
        arrays["yielding_positions"] = np.concatenate(yielding)
    arrays |= bias.arrays("bias") | output_penalty.arrays()
    if penalty is not None:
        empty = np.zeros(0, dtype=np.int64)
        arrays |= {"seen_positions": empty, "seen_tokens": empty} | seen.arrays("seen")
        arrays["penalty"] = penalty
    processing = LogitsProcessing(
        any_mask=any(name in arrays for name in (
            "restricted_positions", "banned_positions", "stop_banned_positions")),
        any_logit_bias="bias_positions" in arrays,
        any_repetition_penalty=penalty is not None,
        any_output_penalty="output_penalty_positions" in arrays,
    )
    return processing, arrays


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


def _flat_index(
    logits: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """Indices of (position, token) pairs into `logits.view(-1)` (logits [P, V] contiguous)."""
    return positions * logits.shape[1] + tokens  # [N]


def penalise(
    logits: torch.Tensor,
    seen_positions: torch.Tensor,
    seen_tokens: torch.Tensor,
    penalty: torch.Tensor,
    in_place: bool = False,
) -> torch.Tensor:
    """Hugging Face's rule: a seen token's logit is divided by the penalty if > 0, else
    multiplied. logits [S, V] (contiguous when `in_place`); seen_* [N] index pairs (a pair
    seen twice is penalised once); penalty [S]. Only the pairs are read and written."""
    if not in_place:
        logits = logits.clone(memory_format=torch.contiguous_format)
    flat, index = logits.view(-1), _flat_index(logits, seen_positions, seen_tokens)
    seen, pair_penalty = flat.index_select(0, index), penalty.index_select(0, seen_positions)
    # A repeated pair reads the logit before either write, so both write the same value.
    flat.index_copy_(0, index, torch.where(seen > 0, seen / pair_penalty, seen * pair_penalty))
    return logits


def _add_at(
    logits: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor
) -> None:
    """logits[positions, tokens] += values, in place (logits contiguous; distinct pairs)."""
    flat, index = logits.view(-1), _flat_index(logits, positions, tokens)
    flat.index_copy_(0, index, flat.index_select(0, index) + values)


def apply_repetition_penalty(
    logits: torch.Tensor, rows: list[SamplingRow], offsets: list[int]
) -> torch.Tensor:
    """`penalise` with the pairs of `repetition_penalty_arrays` (rows own `offsets`)."""
    if all(row.params.repetition_penalty == 1.0 for row in rows):
        return logits
    arrays = repetition_penalty_arrays(rows, offsets, logits.shape[1])
    return penalise(logits, *(torch.from_numpy(a).to(logits.device) for a in arrays))


def _removed_tokens(
    shape: tuple[int, int], tensors: dict[str, torch.Tensor], token_bitmask: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None:
    """[P, V] bool: the tokens some mask forbids (None when no mask is on)."""
    removed = None
    if "restricted_positions" in tensors:
        removed = torch.zeros(shape, dtype=torch.bool, device=device)
        removed.index_fill_(0, tensors["restricted_positions"], True)
        if "allowed_positions" in tensors:
            index = tensors["allowed_positions"] * shape[1] + tensors["allowed_tokens"]
            removed.view(-1).index_fill_(0, index, False)
    if token_bitmask is not None:
        outside = ~allowed_tokens(token_bitmask, shape[1], device)
        removed = outside if removed is None else removed.logical_or_(outside)
    if "banned_positions" in tensors:
        if removed is None:
            removed = torch.zeros(shape, dtype=torch.bool, device=device)
        removed = removed.contiguous()
        index = tensors["banned_positions"] * shape[1] + tensors["banned_tokens"]
        removed.view(-1).index_fill_(0, index, True)
    if "stop_banned_positions" in tensors:
        removed = _ban_stop_tokens(shape, tensors, removed, device)
    return removed


def _ban_stop_tokens(
    shape: tuple[int, int], tensors: dict[str, torch.Tensor], removed: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """`removed` plus min_tokens' stop tokens, except at yielding positions (constrained rows)
    that would be left without a token: there the grammar allows only stop tokens (it is
    complete), and vLLM lets them through."""
    stop_banned = torch.zeros(shape, dtype=torch.bool, device=device)
    index = tensors["stop_banned_positions"] * shape[1] + tensors["stop_banned_tokens"]
    stop_banned.view(-1).index_fill_(0, index, True)
    if "yielding_positions" in tensors:
        combined = stop_banned if removed is None else stop_banned | removed
        is_yielding = torch.zeros(shape[0], dtype=torch.bool, device=device)
        is_yielding.index_fill_(0, tensors["yielding_positions"], True)
        stop_banned.masked_fill_((is_yielding & combined.all(-1))[:, None], False)  # [P, 1]
    return stop_banned if removed is None else removed.logical_or_(stop_banned)


def process_logits(
    logits: torch.Tensor,
    processing: LogitsProcessing,
    tensors: dict[str, torch.Tensor],
    token_bitmask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masks, bias and penalties (the module's order) on the device, without a host sync.

    logits [P, V] float32 (never modified in place); `tensors` are `processing_arrays`'
    arrays on the logits' device; `token_bitmask` [P, >= ceil(V / 32)] int32. Returns the
    processed logits [P, V] and the dead-end positions [P] bool (None when no mask is on).
    """
    no_token = None
    removed = None
    if processing.any_mask or token_bitmask is not None:
        removed = _removed_tokens(tuple(logits.shape), tensors, token_bitmask, logits.device)
    if removed is not None:
        no_token = removed.all(-1)  # [P]
        # A dead end stays unmasked: all -inf would put NaNs through the softmax, and its
        # result is replaced by NO_ALLOWED_TOKEN_ID anyway.
        logits = logits.masked_fill(removed & ~no_token[:, None], float("-inf"))
    if processing.any_logit_bias or processing.any_repetition_penalty:
        is_sparse = True
    else:
        is_sparse = processing.any_output_penalty
    if is_sparse:  # the steps below write in place: into a contiguous copy of their own
        if removed is None:
            logits = logits.clone(memory_format=torch.contiguous_format)
        logits = logits.contiguous()
    if processing.any_logit_bias:
        _add_at(logits, tensors["bias_positions"], tensors["bias_tokens"], tensors["bias_values"])
    if processing.any_repetition_penalty:
        penalise(logits, tensors["seen_positions"], tensors["seen_tokens"], tensors["penalty"],
                 in_place=True)
    if processing.any_output_penalty:
        _add_at(logits, tensors["output_penalty_positions"], tensors["output_penalty_tokens"],
                tensors["output_penalty_values"])
    return logits, no_token
