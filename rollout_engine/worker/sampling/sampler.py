"""Turns target logits into tokens: logits processing, temperature, filters, random draws.

Per sampled position (a row with drafts owns len(drafts) + 1 consecutive positions; position
j has seen the row's output and drafts[:j]), in this order:

1. Logits processing (`logits_processing`): the masks (structured-outputs bitmask,
   `allowed_token_ids`, `bad_words`, `min_tokens`), then `logit_bias`, then the penalties
   (repetition over prompt + output, then frequency and presence over the output). A
   position the masks leave no token answers NO_ALLOWED_TOKEN_ID with logprob -inf.
2. Greedy rows: the argmax of the processed logits; their distribution is the processed
   logits' log-softmax at temperature 1.
3. Sampled rows: temperature, then top-k, top-p and min-p, then the inverse-CDF draw of the
   position's own uniform (`position_uniform`); drafts are verified by `rejection_sampler`.
4. Logprobs: each returned token's logprob under the distribution it came from (2 or 3), or,
   for rows with `logprobs_mode="raw_logprobs"`, under the model's raw `log_softmax(logits)`.
   Rows with `logprobs=k` also get, per returned token, its rank (1 + the number of tokens
   with a strictly larger logprob) and the k most likely tokens of that same distribution.
5. Sampling masks (`sampling_support`), for rows with `return_sampling_mask`: per returned
   token, the ids its distribution (2 or 3) kept.

Sampling is split in two so that a step waits for the device once: `Sampler.plan` runs on
the host before the forward and turns the rows' parameters into arrays (they travel to the
device with the step's inputs) and branch decisions (which would otherwise need a host
sync each); `Sampler.sample_positions` then works on the device and `Sampler.to_results`
brings back the tokens, logprobs and top logprobs in one copy. A batch that uses none of
logits processing or top logprobs takes the same path, at the same cost, as plain sampling.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rollout_engine.core.scheduler_output import NO_ALLOWED_TOKEN_ID
from rollout_engine.protocol import SamplingParams
from rollout_engine.worker.ragged import index_within_runs
from rollout_engine.worker.sampling.logits_processing import (  # noqa: F401 (re-exported)
    LogitsProcessing,
    allowed_tokens,
    apply_repetition_penalty,
    apply_token_bitmask,
    penalise,
    process_logits,
    processing_arrays,
    repetition_penalty_arrays,
)
from rollout_engine.worker.sampling.random_streams import (  # noqa: F401 (re-exported)
    position_uniform,
    position_uniforms,
    request_stream_seed,
)
from rollout_engine.worker.sampling.rejection_sampler import (
    SampleResult,
    accept_matching_drafts,
    inverse_cdf_sample,
)
from rollout_engine.worker.sampling.sampling_filters import (  # noqa: F401 (re-exported)
    FilterDecisions,
    FilterHints,
    filter_decisions,
    filter_hints,
    filter_logits,
)
from rollout_engine.worker.sampling.sampling_support import (
    SamplingMaskPlan,
    attach_sampling_masks,
    plan_sampling_masks,
    sampled_support,
)
from rollout_engine.worker.sampling.top_logprobs import (
    RAW_LOGPROBS,
    PositionLogprobs,
    attach_top_logprobs,
    plan_top_logprobs,
    reported_logprobs,
)


@dataclass
class SamplingRow:
    """One request's sampling context for this step."""

    params: SamplingParams
    stream_seed: int | None
    """The request's own random stream (`request_stream_seed`), or None: a fresh stream
    drawn from the sampler's default one, in row order."""
    token_history: list[int]
    """Prompt + committed output tokens when processing reads them (`needs_history`: the
    repetition, presence and frequency penalties, bad words of several tokens); else []."""
    draft_token_ids: list[int]
    """Speculative drafts to verify ([] for a plain step)."""
    first_output_index: int = 0
    """Output index of the row's first sampled position (= its committed output tokens)."""
    num_prompt_tokens: int = 0
    """`token_history[num_prompt_tokens:]` is the committed output (when history is filled,
    it holds exactly `first_output_index` output tokens)."""
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    """`SamplingParams.bad_words`, each word as token ids (tokenized by the engine)."""


@dataclass
class SamplingPlan:
    """A sampling call as the host sees it before any logits exist.

    `arrays` hold one entry per sampled position (greedy and sampled positions apart), and
    the sparse arrays of logits processing and top logprobs; the flags decide the branches
    `Sampler.sample_positions` takes without asking the device.
    """

    drafts: list[list[int]]
    """Each row's drafts; row i owns len(drafts[i]) + 1 consecutive logits rows."""
    num_positions: int
    num_greedy: int
    num_sampled: int
    any_temperature: bool
    num_sort_rows: int
    max_k: int
    any_top_p: bool
    any_min_p: bool
    processing: LogitsProcessing = field(default_factory=LogitsProcessing)
    num_top_logprobs: list[int] | None = None
    """Each row's `logprobs` (-1: none); None when no row asks."""
    max_top_logprobs: int = 0
    """K: the most top logprobs a position of this call returns (min(max k, vocab))."""
    num_top_positions: int = 0
    """L: positions of rows that ask for top logprobs (in position order)."""
    num_raw_positions: int = 0
    """R: positions of rows that report raw logprobs."""
    sampling_masks: SamplingMaskPlan | None = None
    """Which positions return sampling masks; None when no row asks."""
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


class Sampler:
    """Samples (and verifies drafts) for every row of a step in one batched call.

    Logprobs are fp32 log-softmax values of the distribution actually sampled from: after
    logits processing, temperature, top-k, top-p and min-p (removed tokens are -inf). For
    greedy rows they are the log-softmax of the processed logits at temperature 1. Rows
    with `logprobs_mode="raw_logprobs"` report the model's raw log-softmax instead.

    Randomness: the token at output position i of a row is the inverse-CDF draw of
    `position_uniform(stream_seed, i)` (see `rejection_sampler`), so a seeded request's
    tokens do not depend on the batch, nor on drafting. Rows without a stream take a fresh
    one from the sampler's default stream, in row order. Greedy rows draw nothing, and no
    logits processing or logprobs option draws anything.

    `exact_in_one_pass` (default: on for GPUs) sorts top-p rows over the whole vocabulary
    instead of a partial sort with a fallback whose check would sync; the tokens are the same.
    `eos_token_ids` are the model's EOS ids, which `min_tokens` masks.
    """

    def __init__(
        self,
        seed: int = 0,
        exact_in_one_pass: bool | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._default_stream = random.Random(seed)
        self.exact_in_one_pass = exact_in_one_pass
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        """logits: [sum(len(drafts_i) + 1), vocab]; row i owns len(drafts_i) + 1 consecutive
        logits rows; position j is the target's distribution for the token after draft j-1
        (j=0: after the last committed token)."""
        plan = self.plan(rows, logits.shape[1])
        tensors = {name: torch.from_numpy(a).to(logits.device) for name, a in plan.arrays.items()}
        return self.sample(logits, plan, tensors)

    def plan(self, rows: list[SamplingRow], vocab_size: int) -> SamplingPlan:
        """Host work of a call: per-position parameters, uniforms and branch decisions.

        One Python pass over the rows, numpy per position. Draws the default stream's seeds,
        so call it once per call, in step order.
        """
        num_rows = len(rows)
        num_drafts = np.fromiter((len(row.draft_token_ids) for row in rows), np.int64, num_rows)
        for row, count in zip(rows, num_drafts):
            if count:
                assert all(0 <= d < vocab_size for d in row.draft_token_ids), (
                    f"draft ids {row.draft_token_ids} outside the vocabulary of {vocab_size}"
                )
        # The last three columns: whether a row uses logits processing, top or raw logprobs,
        # sampling masks (plain rows pay these flag checks only).
        columns = [
            (p.temperature, p.top_k, p.top_p, p.min_p, p.is_greedy,
             p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
             or p.frequency_penalty != 0.0 or p.min_tokens > row.first_output_index
             or p.allowed_token_ids is not None or bool(p.logit_bias or row.bad_words_token_ids),
             p.logprobs is not None or p.logprobs_mode == RAW_LOGPROBS,
             p.return_sampling_mask)
            for row in rows
            for p in (row.params,)
        ]
        temperature, top_k, top_p, min_p, greedy, processed, reports, masks = (
            np.array(column, dtype=dtype).reshape(num_rows)
            for column, dtype in zip(
                zip(*columns) if columns else [()] * 8,
                (np.float32, np.int64, np.float32, np.float32, bool, bool, bool, bool),
            )
        )
        # Each sampled row's stream: its own, else a fresh one from the default stream.
        draw = self._default_stream.getrandbits
        stream_seeds = np.array(
            [0 if g else (row.stream_seed if row.stream_seed is not None else draw(64))
             for row, g in zip(rows, greedy.tolist())],
            dtype=np.uint64,
        ).reshape(num_rows)
        first_index = np.fromiter((row.first_output_index for row in rows), np.int64, num_rows)

        # Per position: row i owns num_drafts[i] + 1 consecutive positions.
        counts = num_drafts + 1
        row_of_position = np.repeat(np.arange(num_rows), counts)
        offset_in_row = index_within_runs(counts)
        position_is_greedy = greedy[row_of_position]
        sampled_positions = np.flatnonzero(~position_is_greedy)
        sampled_rows = row_of_position[sampled_positions]
        filters = filter_decisions(
            top_k[sampled_rows], top_p[sampled_rows], min_p[sampled_rows], vocab_size
        )
        temperature = temperature[sampled_rows]
        uniforms = position_uniforms(
            stream_seeds[sampled_rows],
            first_index[sampled_rows] + offset_in_row[sampled_positions],
        )
        plan = SamplingPlan(
            drafts=[row.draft_token_ids for row in rows],
            num_positions=len(row_of_position),
            num_greedy=len(row_of_position) - len(sampled_positions),
            num_sampled=len(sampled_positions),
            any_temperature=bool((temperature != 1.0).any()),
            num_sort_rows=len(filters.sort_rows),
            max_k=filters.max_k,
            any_top_p=filters.any_top_p,
            any_min_p=filters.any_min_p,
        )
        # Only what `sample` will read: fewer arrays, less to pack and move.
        arrays = plan.arrays
        if plan.num_greedy and plan.num_sampled:
            arrays["greedy_positions"] = np.flatnonzero(position_is_greedy)
            arrays["sampled_positions"] = sampled_positions
        if plan.num_sampled:
            arrays["uniforms"] = uniforms
        if plan.any_temperature:
            arrays["temperature"] = temperature
        if plan.num_sort_rows:
            arrays |= {"sort_rows": filters.sort_rows, "top_k": filters.top_k,
                       "top_p": top_p[sampled_rows]}
        if plan.any_min_p:
            arrays["min_p"] = min_p[sampled_rows]
        if processed.any():
            self._plan_processing(plan, rows, counts, np.flatnonzero(processed), vocab_size)
        if reports.any():
            plan_top_logprobs(plan, rows, counts, position_is_greedy, vocab_size)
        if masks.any():
            plan_sampling_masks(plan, masks, counts, position_is_greedy)
        return plan

    def _plan_processing(
        self, plan: SamplingPlan, rows: list[SamplingRow], counts: np.ndarray,
        used: np.ndarray, vocab_size: int,
    ) -> None:
        """Logits processing's arrays, built from the rows that use it (`used`)."""
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        used_rows = [rows[i] for i in used.tolist()]
        used_offsets = [(offsets[i], offsets[i + 1]) for i in used.tolist()]
        plan.processing, arrays = processing_arrays(
            used_rows, used_offsets, vocab_size, self.eos_token_ids, plan.num_positions
        )
        plan.arrays |= arrays

    def sample(
        self, logits: torch.Tensor, plan: SamplingPlan, tensors: dict[str, torch.Tensor]
    ) -> list[SampleResult]:
        """Device work of a call; `tensors` are `plan.arrays` on the logits' device.

        The only host sync is the final copy of the tokens and their logprobs.
        """
        return self.to_results(*self.sample_positions(logits, plan, tensors), plan)

    @staticmethod
    def to_results(
        token_ids: torch.Tensor, logprobs: PositionLogprobs, plan: SamplingPlan
    ) -> list[SampleResult]:
        """Bring a call's tokens, logprobs and top logprobs to the host in one copy (its one
        sync); accept drafts; give each row that asks one `TopLogprobs` per returned token,
        and one sampling mask (a second copy, only when a sampled row asks for masks)."""
        # Token ids and ranks are exact in float64.
        parts = [token_ids.double(), logprobs.logprobs.double()]
        if logprobs.ranks is not None:
            parts += [logprobs.ranks.double(), logprobs.top_token_ids.double().reshape(-1),
                      logprobs.top_logprobs.double().reshape(-1)]
        on_host = torch.cat(parts).cpu()
        num_positions = plan.num_positions
        results = accept_matching_drafts(
            on_host[:num_positions].long().tolist(),
            on_host[num_positions : 2 * num_positions].tolist(),
            plan.drafts,
        )
        if logprobs.ranks is not None:
            attach_top_logprobs(results, on_host[2 * num_positions :], plan)
        if plan.sampling_masks is not None:
            attach_sampling_masks(results, logprobs.sampling_support, plan)
        return results

    def sample_positions(
        self,
        logits: torch.Tensor,
        plan: SamplingPlan,
        tensors: dict[str, torch.Tensor],
        token_bitmask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, PositionLogprobs]:
        """The target's token at every position and the logprobs to report, on the device, no
        sync: [num_positions] int64 (row i's positions are consecutive) and `PositionLogprobs`.

        `token_bitmask` ([num_positions, >= ceil(vocab / 32)] int32, structured outputs)
        removes the tokens a grammar forbids before anything else, so logprobs are those of the
        constrained distribution. A position whose masks (bitmask, allowed ids, bad words,
        min_tokens) allow no token of the vocabulary yields NO_ALLOWED_TOKEN_ID with logprob
        -inf: never a token."""
        assert logits.dim() == 2 and logits.shape[0] == plan.num_positions, (
            f"expected logits of shape [{plan.num_positions}, vocab], got {tuple(logits.shape)}"
        )
        raw_logits = logits.float()  # [P, V]; never modified in place
        logits, no_token = process_logits(raw_logits, plan.processing, tensors, token_bitmask)
        parts = {}  # part -> (positions or None for all, token ids, logprobs, distribution)
        if plan.num_greedy:
            greedy = self._rows(logits, tensors.get("greedy_positions"), plan.num_greedy)
            token_ids = greedy.argmax(-1)  # [G]
            distribution = greedy.log_softmax(-1)  # [G, V]
            parts["greedy"] = (tensors.get("greedy_positions"), token_ids,
                               distribution.gather(1, token_ids[:, None]).squeeze(1),
                               distribution)
        if plan.num_sampled:
            distribution = self._processed_logprobs(logits, plan, tensors)  # [S, V]
            token_ids = inverse_cdf_sample(distribution.exp(), tensors["uniforms"])  # [S]
            parts["sampled"] = (tensors.get("sampled_positions"), token_ids,
                                distribution.gather(1, token_ids[:, None]).squeeze(1),
                                distribution)
        if len(parts) == 1:
            _, token_ids, logprobs, _ = next(iter(parts.values()))
        else:
            token_ids = logits.new_empty(plan.num_positions, dtype=torch.int64)
            logprobs = logits.new_empty(plan.num_positions)
            for positions, ids, lps, _ in parts.values():
                token_ids.index_copy_(0, positions, ids)
                logprobs.index_copy_(0, positions, lps)
        reported = PositionLogprobs(logprobs)
        if plan.num_raw_positions or plan.num_top_positions:
            reported = reported_logprobs(raw_logits, parts, token_ids, logprobs, plan, tensors)
        if plan.sampling_masks is not None and plan.sampling_masks.num_sampled:
            reported.sampling_support = sampled_support(parts["sampled"][3],
                                                        tensors.get("mask_sampled_rows"))
        if no_token is not None:
            token_ids = token_ids.masked_fill(no_token, NO_ALLOWED_TOKEN_ID)
            reported.logprobs = reported.logprobs.masked_fill(no_token, float("-inf"))
        return token_ids, reported

    @staticmethod
    def _rows(
        logits: torch.Tensor, positions: torch.Tensor | None, count: int
    ) -> torch.Tensor:
        return logits if count == logits.shape[0] else logits.index_select(0, positions)

    def _processed_logprobs(
        self, logits: torch.Tensor, plan: SamplingPlan, tensors: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Log-softmax after temperature and filters, for every sampled position: [S, V]."""
        scaled = self._rows(logits, tensors.get("sampled_positions"), plan.num_sampled)
        if plan.any_temperature:
            scaled = scaled / tensors["temperature"][:, None]
        if not (plan.num_sort_rows or plan.any_min_p):
            return scaled.log_softmax(-1)
        exact_in_one_pass = self.exact_in_one_pass
        if exact_in_one_pass is None:
            exact_in_one_pass = logits.is_cuda
        hints = FilterHints(
            sort_rows=tensors.get("sort_rows"),
            num_sort_rows=plan.num_sort_rows,
            max_k=plan.max_k,
            any_top_p=plan.any_top_p,
            any_min_p=plan.any_min_p,
            exact_in_one_pass=exact_in_one_pass,
        )
        filtered = filter_logits(
            scaled, tensors.get("top_k"), tensors.get("top_p"), tensors.get("min_p"), hints
        )
        return filtered.log_softmax(-1)
