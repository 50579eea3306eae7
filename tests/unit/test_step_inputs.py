"""Host work per step: vectorised inputs, one packed upload, and no host sync but the last."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.host_overhead import first_step, per_token_build
from rollout_engine.protocol import SamplingParams
from rollout_engine.worker.persistent_batch import PersistentBatch, StepRequest
from rollout_engine.worker.sampling.sampler import Sampler
from rollout_engine.worker.staging import HostStaging
from rollout_engine.worker.step_inputs import build_step_inputs
from tests.unit.test_sampler import make_row, mixed_batch, random_logits

BLOCK_SIZE = 4
VOCAB_SIZE = 300

# Ops whose result the host must wait for (their output size or value depends on data).
_SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "is_nonzero",
                "equal", "repeat_interleave")


class SyncCounter(TorchDispatchMode):
    """Counts the ops that make the host wait for the device (on a GPU they sync; on the
    CPU they would, if the tensors lived on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()
        self.num_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if not name.startswith("lift_fresh"):  # wrapping a fresh host array is no work
            self.num_ops += 1
        if any(op in name for op in _SYNCING_OPS):
            self.syncs[name] += 1
        if name.startswith(("index.", "index_put")):  # a boolean mask index means nonzero
            indices = args[1] if len(args) > 1 else []
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.syncs["boolean mask index"] += 1
        return func(*args, **(kwargs or {}))


def random_step(seed: int, num_reqs: int = 12) -> tuple[PersistentBatch, list[StepRequest]]:
    """Prefill chunks, decodes and drafting decodes, with random block tables."""
    rng = random.Random(seed)
    free_blocks = list(range(200))
    rng.shuffle(free_blocks)
    requests = []
    for i in range(num_reqs):
        kind = rng.choice(["prefill", "decode", "draft", "partial"])
        start = rng.randrange(0, 40)
        num_spec = rng.randrange(1, 4) if kind == "draft" else 0
        query_len = {"prefill": rng.randrange(2, 20), "partial": rng.randrange(2, 9)}.get(
            kind, 1 + num_spec
        )
        num_committed = start + query_len - num_spec + (rng.randrange(1, 5) if kind == "partial" else 0)
        num_blocks = -(-(start + query_len) // BLOCK_SIZE) + rng.randrange(0, 2)
        params = rng.choice([
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.8, top_p=0.9, seed=i),
            SamplingParams(top_k=5, min_p=0.05, repetition_penalty=1.3),
        ])
        requests.append((
            f"r{i}",
            [rng.randrange(VOCAB_SIZE) for _ in range(num_committed)],
            start,
            query_len,
            [rng.randrange(VOCAB_SIZE) for _ in range(num_spec)],
            [free_blocks.pop() for _ in range(num_blocks)],
            kind != "partial",
            params,
            rng.randrange(0, 5),
        ))
    return first_step(requests)


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_step_inputs_match_the_per_token_build(seed: int, pack: bool) -> None:
    batch, scheduled = random_step(seed)
    staging = HostStaging("cpu", pack=pack)
    step = build_step_inputs(scheduled, BLOCK_SIZE, VOCAB_SIZE, Sampler(), staging,
                             batch, host_block_tables=True)
    input_ids, positions, rows, expected, _ = per_token_build(
        scheduled, Sampler(), "cpu", BLOCK_SIZE, VOCAB_SIZE
    )
    assert step.input_ids.tolist() == input_ids.tolist()
    assert step.positions.tolist() == positions.tolist()
    assert step.logits_rows.tolist() == rows.tolist()
    assert step.logits_rows.shape[0] == len(rows)
    got = step.metadata
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
        assert getattr(got, name).dtype == getattr(expected, name).dtype, name
    assert got.query_lens_cpu == expected.query_lens_cpu
    assert got.seq_lens_cpu == expected.seq_lens_cpu
    assert got.block_tables_cpu == expected.block_tables_cpu
    assert step.sampled_request_ids == [r.request_id for r in scheduled if r.needs_sample]
    assert staging.num_copies == (1 if pack else 0)


def test_packed_upload_keeps_dtypes_shapes_and_values_across_slot_reuse() -> None:
    staging = HostStaging("cpu", num_slots=2, pack=True)
    rng = np.random.default_rng(0)
    for step in range(5):
        arrays = {
            "a": rng.integers(0, 1 << 40, size=(3 + step,), dtype=np.int64),
            "b": rng.random((2, 5 + step)).astype(np.float32),  # odd byte counts: alignment
            "c": rng.integers(0, 100, size=(7,), dtype=np.int32),
            "d": rng.random(0),
            "u": rng.random((step + 1,)),
        }
        tensors = staging.upload(arrays)
        for name, array in arrays.items():
            assert tensors[name].dtype == torch.from_numpy(array).dtype
            assert np.array_equal(tensors[name].numpy(), array), name
    assert staging.num_copies == 5


def test_sampling_on_the_device_never_syncs_before_its_one_copy() -> None:
    # Greedy, sampled, seeded, drafting, penalised and filtered rows side by side.
    rows, _ = mixed_batch(make_row(temperature=0.0, repetition_penalty=1.2, history=[9]), 6)
    logits = random_logits(sum(len(r.draft_token_ids) + 1 for r in rows), 256)
    sampler = Sampler(exact_in_one_pass=True)
    plan = sampler.plan(rows, 256)
    tensors = {name: torch.from_numpy(a) for name, a in plan.arrays.items()}
    with SyncCounter() as counter:
        results = sampler.sample(logits, plan, tensors)
    assert counter.syncs == Counter()
    # The same tokens as the partial sort with its (syncing) fallback; the counter sees it.
    partial = Sampler(exact_in_one_pass=False)
    plan = partial.plan(rows, 256)
    tensors = {name: torch.from_numpy(a) for name, a in plan.arrays.items()}
    with SyncCounter() as counter:
        assert partial.sample(logits, plan, tensors) == results
    assert counter.syncs["_local_scalar_dense.default"] >= 1


def test_building_a_step_is_host_only() -> None:
    """No tensor op at all runs before the upload: the host work is numpy."""
    batch, scheduled = random_step(3)
    with SyncCounter() as counter:
        build_step_inputs(scheduled, BLOCK_SIZE, VOCAB_SIZE, Sampler(), HostStaging("cpu"),
                          batch)
    assert counter.num_ops == 0
