"""Host time per step: building a step's model and sampler inputs, now and before.

`vectorised` is what the model runner does: one Python pass over the scheduled requests,
numpy for everything per token, and one packed upload (`build_step_inputs`). `per-token`
is the path it replaced, kept here as the competitor: a Python loop per token for the
positions and the slot mapping, and one tensor (a pageable copy on a GPU) per input.
Both build the same tensors; the sampler's per-row parameters are included in both.

The batches are GRPO-shaped decode steps (every request at a position around
`--context`, 16-token blocks) and spec-decode verify steps (k drafts per request).
Host work does not depend on the device, so this runs on the CPU too; `--device cuda`
adds the copies themselves.

    python -m benchmarks.host_overhead
    python -m benchmarks.host_overhead --device cuda --batch-sizes 1 64 256 1024
"""

from __future__ import annotations

import argparse
import random
import time
from functools import partial

import torch

from kernels import AttentionMetadata
from rollout_engine.core.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from rollout_engine.protocol import SamplingParams
from rollout_engine.worker.persistent_batch import PersistentBatch, StepRequest
from rollout_engine.worker.sampling.sampler import Sampler
from rollout_engine.worker.staging import HostStaging
from rollout_engine.worker.step_inputs import build_step_inputs, sampling_row

BLOCK_SIZE = 16
VOCAB_SIZE = 151_936


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=1024, help="tokens before the step")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=50)
    return parser.parse_args()


def first_step(
    requests: list[tuple[str, list[int], int, int, list[int], list[int], bool, SamplingParams, int]],
) -> tuple[PersistentBatch, list[StepRequest]]:
    """A worker's batch holding `requests`, each scheduled for the first time, and the step's
    requests as it hands them to `build_step_inputs`. Each is (id, committed tokens, start
    position, positions to compute, drafts, block ids, needs sample, params, output index)."""
    output = SchedulerOutput()
    for request_id, tokens, start, num_tokens, drafts, blocks, needs_sample, params, num_out in (
        requests
    ):
        output.new_requests.append(NewRequestData(request_id, tokens, [], params, 0))
        output.scheduled_requests.append(ScheduledRequest(
            request_id=request_id, start_position=start, num_tokens=num_tokens,
            new_token_ids=[], new_block_ids=blocks, spec_token_ids=drafts,
            needs_sample=needs_sample, num_output_tokens=num_out,
        ))
    batch = PersistentBatch()
    return batch, batch.update(output)


def make_step(
    batch_size: int, context: int, num_spec: int, seed: int = 0
) -> tuple[PersistentBatch, list[StepRequest]]:
    rng = random.Random(seed)
    requests = []
    for i in range(batch_size):
        start = context + rng.randrange(-64, 64)
        num_blocks = -(-(start + 1 + num_spec) // BLOCK_SIZE)
        requests.append((
            f"r{i}",
            [rng.randrange(VOCAB_SIZE) for _ in range(start + 1)],
            start,
            1 + num_spec,
            [rng.randrange(VOCAB_SIZE) for _ in range(num_spec)],
            rng.sample(range(100_000), num_blocks),
            True,
            SamplingParams(temperature=1.0, max_tokens=2048, seed=i),
            start - 256,
        ))
    return first_step(requests)


def per_token_build(
    scheduled: list[StepRequest],
    sampler: Sampler,
    device: str,
    block_size: int = BLOCK_SIZE,
    vocab_size: int = VOCAB_SIZE,
):
    """The replaced path: Python per token, and one tensor per input (also the oracle of
    `tests/unit/test_step_inputs.py`). (input_ids, positions, logits rows, metadata,
    sampling tensors)."""
    input_ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    end = 0
    for req in scheduled:
        input_ids.extend(req.input_token_ids)
        positions.extend(range(req.start_position, req.start_position + len(req.input_token_ids)))
        end += len(req.input_token_ids)
        if req.needs_sample:
            rows.extend(range(end - req.num_spec_tokens - 1, end))
    metadata = AttentionMetadata.build(
        query_lens=[len(r.input_token_ids) for r in scheduled],
        seq_lens=[r.start_position + len(r.input_token_ids) for r in scheduled],
        block_tables=[r.block_ids for r in scheduled],
        block_size=block_size,
        device=device,
    )
    plan = sampler.plan([sampling_row(r) for r in scheduled if r.needs_sample], vocab_size)
    tensors = {name: torch.from_numpy(a).to(device) for name, a in plan.arrays.items()}
    return (
        torch.tensor(input_ids, device=device),
        torch.tensor(positions, device=device),
        torch.tensor(rows, device=device),
        metadata,
        tensors,
    )


def time_per_step(fn, repeats: int, device: str) -> float:
    """Median seconds of `fn` (with the device synced after, so copies count)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    args = parse_args()
    sampler, staging = Sampler(), HostStaging(args.device)
    print(f"host time per step, device {args.device}, context ~{args.context} tokens, "
          f"block {BLOCK_SIZE}, median of {args.repeats}")
    header = f"{'step':<26}{'per-token (us)':>16}{'vectorised (us)':>17}{'speed-up':>10}"
    print(header)
    print("-" * len(header))
    for num_spec in (0, args.num_speculative_tokens):
        for batch_size in args.batch_sizes:
            batch, scheduled = make_step(batch_size, args.context, num_spec)
            old = time_per_step(partial(per_token_build, scheduled, sampler, args.device),
                                args.repeats, args.device)
            new = time_per_step(
                partial(build_step_inputs, scheduled, BLOCK_SIZE, VOCAB_SIZE, sampler, staging,
                        batch),
                args.repeats, args.device,
            )
            name = f"decode x {batch_size}" if num_spec == 0 else f"verify {num_spec} x {batch_size}"
            print(f"{name:<26}{old * 1e6:>16.0f}{new * 1e6:>17.0f}{old / new:>9.2f}x")


if __name__ == "__main__":
    main()
