"""A step's model and sampler inputs, built on the host with array operations.

Per step the host does O(batch) Python work (one pass over the scheduled requests to read
their lengths, positions, tokens and block tables) and everything per token is numpy:
positions, the slot mapping and the rows to sample. All arrays then reach the device in
one copy (`HostStaging`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from kernels import AttentionMetadata
from rollout_engine.worker.persistent_batch import PersistentBatch, StepRequest
from rollout_engine.worker.ragged import index_within_runs
from rollout_engine.worker.sampling.logits_processing import needs_history
from rollout_engine.worker.sampling.prompt_logprobs import PromptLogprobsJob, prompt_logprobs_jobs
from rollout_engine.worker.sampling.sampler import (
    Sampler,
    SamplingPlan,
    SamplingRow,
    request_stream_seed,
)
from rollout_engine.worker.staging import HostStaging

_SAMPLING_PREFIX = "sampling."


@dataclass
class StepInputs:
    """Device tensors for one forward, and what the sampler needs after it."""

    input_ids: torch.Tensor
    """[T] int64: every scheduled token, request after request (drafts last)."""
    positions: torch.Tensor
    """[T] int64."""
    metadata: AttentionMetadata
    logits_rows: torch.Tensor
    """[P] int64: rows of the flat batch whose logits are sampled (last committed token and
    each draft of every request that samples)."""
    sampled_request_ids: list[str]
    sampling_plan: SamplingPlan
    sampling_tensors: dict[str, torch.Tensor]
    is_uniform_decode: bool
    """Every request has exactly one query token and samples it (a plain decode step)."""
    patch_positions: torch.Tensor | None = None
    """Async scheduling: [R] rows of `input_ids` holding placeholders, to be filled with
    the previous step's sampled tokens at `patch_rows` (on the device, before the forward)."""
    patch_rows: torch.Tensor | None = None
    prompt_logprobs_jobs: list[PromptLogprobsJob] = dataclasses.field(default_factory=list)
    """Requests asking for prompt logprobs: which rows predict which prompt tokens."""

    @functools.cached_property
    def last_positions(self) -> dict[str, int]:
        """Request id -> index of its last sampled position in this step's token vector (what
        the next step's placeholders read; built only when one does)."""
        ends = np.cumsum([len(drafts) + 1 for drafts in self.sampling_plan.drafts]) - 1
        return dict(zip(self.sampled_request_ids, ends.tolist()))


def host_arrays(
    scheduled: list[StepRequest], block_size: int, batch: PersistentBatch
) -> tuple[dict[str, np.ndarray], list[int]]:
    """Model inputs as numpy arrays, and the query lengths as a list."""
    num_reqs = len(scheduled)
    query_lens = np.fromiter((len(r.input_token_ids) for r in scheduled), np.int64, num_reqs)
    starts = np.fromiter((r.start_position for r in scheduled), np.int64, num_reqs)
    num_tokens = int(query_lens.sum())
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    input_ids = np.fromiter(
        chain.from_iterable(r.input_token_ids for r in scheduled), np.int64, num_tokens
    )
    req_of_token = np.repeat(np.arange(num_reqs), query_lens)  # [T]
    positions = starts[req_of_token] + index_within_runs(query_lens)  # [T]
    tables = batch.block_tables(scheduled)
    slot_mapping = (
        tables[req_of_token, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    seq_lens = starts + query_lens
    arrays = {
        "input_ids": input_ids,
        "positions": positions,
        "slot_mapping": slot_mapping,
        "query_start_loc": query_start_loc.astype(np.int32),
        "seq_lens": seq_lens.astype(np.int32),
        "block_tables": tables,
    }
    return arrays, query_lens.tolist()


def logits_rows(scheduled: list[StepRequest], query_start_loc: np.ndarray) -> np.ndarray:
    """Rows of the flat batch to sample: each sampling request's last committed token and
    its drafts (the last num_spec_tokens + 1 rows of its query)."""
    needs = np.fromiter((r.needs_sample for r in scheduled), bool, len(scheduled))
    counts = np.fromiter((r.num_spec_tokens + 1 for r in scheduled), np.int64, len(scheduled))
    ends, counts = query_start_loc[1:][needs], counts[needs]
    return np.repeat(ends - counts, counts) + index_within_runs(counts)


def sampling_row(req: StepRequest) -> SamplingRow:
    params = req.sampling_params
    history: list[int] = []
    if needs_history(params, req.bad_words_token_ids):
        history = req.token_ids  # the request's own list, read-only (no copy)
    drafts = req.input_token_ids[len(req.input_token_ids) - req.num_spec_tokens :]
    seed = params.seed
    return SamplingRow(
        params=params,
        stream_seed=None if seed is None else request_stream_seed(seed, req.sample_index),
        token_history=history,
        draft_token_ids=drafts if req.num_spec_tokens else [],
        first_output_index=req.num_output_tokens,
        num_prompt_tokens=req.num_prompt_tokens,
        bad_words_token_ids=req.bad_words_token_ids,
    )


def build_step_inputs(
    scheduled: list[StepRequest],
    block_size: int,
    vocab_size: int,
    sampler: Sampler,
    staging: HostStaging,
    batch: PersistentBatch,
    host_block_tables: bool = False,
    previous_step: StepInputs | None = None,
) -> StepInputs:
    """Host arrays for the forward and the sampler, moved to the device in one copy.

    `batch` holds the requests' block tables. `host_block_tables` also hands the kernels
    the tables as lists (the CPU kernels plan on the host): the requests' own lists, not
    copies. `previous_step` is the step prepared before this
    one, whose sampled tokens fill the placeholders of async scheduling.
    """
    arrays, query_lens = host_arrays(scheduled, block_size, batch)
    arrays["logits_rows"] = logits_rows(scheduled, arrays["query_start_loc"])
    from_previous = [i for i, r in enumerate(scheduled) if r.input_from_previous_step]
    if from_previous:
        assert previous_step is not None, "placeholders without a previous step"
        previous_positions = previous_step.last_positions
        # A placeholder is its request's only input token: the first of its query.
        arrays["patch_positions"] = arrays["query_start_loc"][from_previous].astype(np.int64)
        arrays["patch_rows"] = np.array(
            [previous_positions[scheduled[i].request_id] for i in from_previous], np.int64
        )
    sampled = [r for r in scheduled if r.needs_sample]
    plan = sampler.plan([sampling_row(r) for r in sampled], vocab_size)
    for name, array in plan.arrays.items():
        arrays[_SAMPLING_PREFIX + name] = array
    on_device = staging.upload(arrays)
    seq_lens = arrays["seq_lens"].tolist()
    metadata = AttentionMetadata(
        slot_mapping=on_device["slot_mapping"],
        query_start_loc=on_device["query_start_loc"],
        seq_lens=on_device["seq_lens"],
        block_tables=on_device["block_tables"],
        block_size=block_size,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_tables_cpu=[r.block_ids for r in scheduled] if host_block_tables else None,
    )
    return StepInputs(
        input_ids=on_device["input_ids"],
        positions=on_device["positions"],
        metadata=metadata,
        logits_rows=on_device["logits_rows"],
        sampled_request_ids=[r.request_id for r in sampled],
        sampling_plan=plan,
        sampling_tensors={
            name[len(_SAMPLING_PREFIX) :]: t
            for name, t in on_device.items()
            if name.startswith(_SAMPLING_PREFIX)
        },
        is_uniform_decode=len(sampled) == len(scheduled)
        and all(q == 1 for q in query_lens),
        patch_positions=on_device.get("patch_positions"),
        patch_rows=on_device.get("patch_rows"),
        prompt_logprobs_jobs=prompt_logprobs_jobs(scheduled, arrays["query_start_loc"]),
    )
