"""The worker's own copy of every request it runs, kept across steps from the scheduler's deltas.

The scheduler sends a request's prompt, parameters and blocks once (`NewRequestData`, when it
is first scheduled or resumed after a preemption) and then, each step, only what changed
(`ScheduledRequest`: tokens committed since, blocks allocated since, drafts). `PersistentBatch`
applies those deltas and hands the step's inputs out as `StepRequest`s. Block tables live in
one numpy table with a row per request, written as blocks arrive: a step copies what is new,
never a request's whole table. The worker never holds a scheduler object.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollout_engine.core.scheduler_output import (
    PLACEHOLDER_TOKEN_ID,
    NewRequestData,
    SchedulerOutput,
)
from rollout_engine.protocol import SamplingParams


@dataclass
class RequestState:
    """What the worker keeps of one request between steps."""

    request_id: str
    num_prompt_tokens: int
    token_ids: list[int]
    """Prompt and committed output tokens, as far as the scheduler has sent them."""
    block_ids: list[int]
    """Its KV blocks, in order; only appended to (a resumed request gets a new list)."""
    sampling_params: SamplingParams
    sample_index: int
    row: int
    """Its row of `PersistentBatch.table`."""
    bad_words_token_ids: list[list[int]]
    prompt_logprobs_start: int
    lora_id: int = 0
    """The LoRA adapter it runs under (0: the base model)."""


@dataclass
class StepRequest:
    """One request's work in a step, as the model runner needs it (built from the state and
    the step's delta; the lists are the state's own, read-only here)."""

    request_id: str
    input_token_ids: list[int]
    """Tokens at positions [start_position, start_position + n), drafts last. With
    `input_from_previous_step` it is one placeholder (`PLACEHOLDER_TOKEN_ID`)."""
    start_position: int
    block_ids: list[int]
    """The whole block table. It may grow while a step that read it runs (the next step's
    delta): readers use the first ceil(seq_len / block_size) entries only."""
    row: int
    num_spec_tokens: int
    needs_sample: bool
    sampling_params: SamplingParams
    sample_index: int
    num_output_tokens: int
    input_from_previous_step: bool
    num_prompt_tokens: int
    token_ids: list[int]
    """Prompt and committed output (penalties read it)."""
    bad_words_token_ids: list[list[int]]
    prompt_logprobs_start: int
    """The first prompt position whose logprob is asked for (0: none)."""
    lora_id: int = 0
    """The LoRA adapter it runs under (0: the base model)."""


class PersistentBatch:
    """Every request the worker holds, by id, and their block tables as one numpy table."""

    def __init__(self, num_rows: int = 64, num_columns: int = 64) -> None:
        self.requests: dict[str, RequestState] = {}
        self.table = np.zeros((num_rows, num_columns), dtype=np.int32)
        """[rows, columns] int32: row `state.row` holds a request's block ids (then stale
        values: `block_tables` pads them)."""
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self.num_block_ids_written = 0
        """Block ids copied into the table so far (what a step's host work costs)."""

    def __len__(self) -> int:
        return len(self.requests)

    def update(self, scheduler_output: SchedulerOutput) -> list[StepRequest]:
        """Apply a step's deltas; the step's requests in batch order. Steps must be applied in
        the order they were scheduled."""
        self.forget_dropped(scheduler_output)
        for new in scheduler_output.new_requests:
            self._add(new)
        step: list[StepRequest] = []
        for scheduled in scheduler_output.scheduled_requests:
            state = self.requests.get(scheduled.request_id)
            if state is None:
                raise KeyError(
                    f"request {scheduled.request_id!r} was scheduled as already held, but the "
                    "worker does not hold it (a delta arrived out of order)"
                )
            state.token_ids += scheduled.new_token_ids
            if scheduled.new_block_ids:
                self._append_blocks(state, scheduled.new_block_ids)
            start = scheduled.start_position
            if scheduled.input_from_previous_step:
                input_ids = [PLACEHOLDER_TOKEN_ID]
            else:
                num_committed = scheduled.num_tokens - scheduled.num_spec_tokens
                input_ids = state.token_ids[start : start + num_committed]
                input_ids += scheduled.spec_token_ids
            step.append(StepRequest(
                request_id=state.request_id,
                input_token_ids=input_ids,
                start_position=start,
                block_ids=state.block_ids,
                row=state.row,
                num_spec_tokens=scheduled.num_spec_tokens,
                needs_sample=scheduled.needs_sample,
                sampling_params=state.sampling_params,
                sample_index=state.sample_index,
                num_output_tokens=scheduled.num_output_tokens,
                input_from_previous_step=scheduled.input_from_previous_step,
                num_prompt_tokens=state.num_prompt_tokens,
                token_ids=state.token_ids,
                bad_words_token_ids=state.bad_words_token_ids,
                prompt_logprobs_start=state.prompt_logprobs_start,
                lora_id=state.lora_id,
            ))
        return step

    def forget_dropped(self, scheduler_output: SchedulerOutput) -> None:
        """Forget the requests a step says finished or were preempted (an empty step says so
        too, though nothing runs)."""
        self.drop(scheduler_output.finished_request_ids)
        self.drop(scheduler_output.preempted_request_ids)

    def drop(self, request_ids: list[str]) -> None:
        """Forget requests (finished or preempted); unknown ids are ignored."""
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self._free_rows.append(state.row)

    def block_tables(self, step: list[StepRequest]) -> np.ndarray:
        """[num_reqs, max blocks] int32: each request's table, padded with 0 (a copy)."""
        num_blocks = np.fromiter((len(r.block_ids) for r in step), np.int64, len(step))
        max_blocks = max(int(num_blocks.max(initial=0)), 1)
        rows = np.fromiter((r.row for r in step), np.int64, len(step))
        tables = self.table[rows, :max_blocks]
        tables[np.arange(max_blocks) >= num_blocks[:, None]] = 0
        return tables

    def _add(self, new: NewRequestData) -> None:
        self.drop([new.request_id])  # a resumed request starts over
        if not self._free_rows:
            self._grow(2 * self.table.shape[0], self.table.shape[1])
        self.requests[new.request_id] = RequestState(
            request_id=new.request_id,
            num_prompt_tokens=len(new.prompt_token_ids),
            token_ids=new.prompt_token_ids + new.output_token_ids,
            block_ids=[],
            sampling_params=new.sampling_params,
            sample_index=new.sample_index,
            row=self._free_rows.pop(),
            bad_words_token_ids=new.bad_words_token_ids,
            prompt_logprobs_start=new.prompt_logprobs_start,
            lora_id=new.lora_id,
        )

    def _append_blocks(self, state: RequestState, block_ids: list[int]) -> None:
        begin, end = len(state.block_ids), len(state.block_ids) + len(block_ids)
        if end > self.table.shape[1]:
            self._grow(self.table.shape[0], max(end, 2 * self.table.shape[1]))
        self.table[state.row, begin:end] = block_ids
        state.block_ids += block_ids
        self.num_block_ids_written += len(block_ids)

    def _grow(self, num_rows: int, num_columns: int) -> None:
        old_rows = self.table.shape[0]
        grown = np.zeros((num_rows, num_columns), dtype=np.int32)
        grown[:old_rows, : self.table.shape[1]] = self.table
        self.table = grown
        self._free_rows[:0] = range(num_rows - 1, old_rows - 1, -1)
