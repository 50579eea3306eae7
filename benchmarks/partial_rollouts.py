"""Partial rollouts against synchronous GRPO steps on a long-tail workload, over gRPC.

Each group (one prompt x n samples) gets its own length, drawn from a log-normal capped at
`--cap` and imposed through the group's `max_tokens` with EOS ignored, so a step's rollout
lasts as long as its longest group. Every mode runs `--steps` training steps against one
`rollout-engine serve` process, each step: push weights (the checkpoint's own tensors: the
weight version advances) and wake, generate `--num-groups` whole groups, sleep (level
`--sleep-level`, "keep" mode), train for a fixed `--train-s` (the trainer's time, a sleep here).

- synchronous: each step's groups in one GenerateBatch call, to completion; nothing carried.
- partial Nx: `trainer_bridge.partial_rollouts.PartialRollouts` keeps N x `--num-groups`
  groups in flight and returns the first whole groups to finish, those carried over from the
  step before first (a step waits for its carried groups that rank among the first
  `--num-groups`); the rest run on across the training phase, kept by the sleep.

Every mode draws from the same stream of groups (prompts, lengths, seeds), taking what it
needs; figures are per returned token. Per mode (its best of `--rounds` rounds, in turn):

- rollout throughput: tokens of the returned groups / wall time of the rollout phases (the
  generation calls only; weight pushes, sleep and wake are in the step time). Tokens of groups
  still in flight at the end are not counted, though their time is;
- mean step time: push + wake + rollout + sleep + training;
- idle fraction of the rollout phase: the time-average of 1 - running / at start, where
  "at start" is the groups in flight during the phase and "running" those not yet finished:
  the share of the phase's batch rows left empty as groups finish (on a GPU, where a decode
  step costs about the same at any batch size, the share of its throughput lost). Taken on the
  client from when each group's call started and its last completion arrived, which is exact
  here (a group's samples share `max_tokens`, so they finish at the same step) and costs the
  engine nothing, where polling `info()` every few ms would take the engine thread's time;
  weighted by phase length over steps;
- off-policy token fraction: tokens of the returned groups sampled by a weight version older
  than the engine's at return (`RolloutBatch.off_policy_token_fraction`);
- rows recomputed: the engine's preemptions over the mode, here the rows running when the
  engine slept in "keep" mode (their KV is recomputed at the wake): the default pool holds
  every row in flight at full length, so none for lack of blocks.

    python -m benchmarks.partial_rollouts                          # tiny model, cap 2048
    python -m benchmarks.partial_rollouts --rounds 1 --steps 5     # a quick look
    python -m benchmarks.partial_rollouts --size small --steps 8   # a larger model

A run of few steps undercounts partial rollouts: the tokens of groups still in flight at the
end took rollout time but are not returned.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import add_model_args, kv_bytes_per_token
from rollout_engine.protocol import RequestOutput
from rollout_engine.tiny_model import build_tiny_model
from trainer_bridge import EngineClient, SamplingParams
from trainer_bridge.colocate import Colocation
from trainer_bridge.partial_rollouts import PartialRollouts, RolloutGroup
from trainer_bridge.server_process import EngineServer

MiB = 1 << 20
GOAL_SPEEDUP = 1.3
GOAL_OVERSAMPLE = 2.0
Group = tuple[str, list[int], SamplingParams]
"""(key, prompt token ids, sampling parameters with the group's max_tokens)."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.set_defaults(size="tiny")
    parser.add_argument("--steps", type=int, default=12, help="training steps per mode")
    parser.add_argument("--num-groups", type=int, default=8, help="groups a step trains on")
    parser.add_argument("--n", type=int, default=8, help="samples per group")
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=64)
    parser.add_argument("--median", type=float, default=48, help="median tokens of a group")
    parser.add_argument("--sigma", type=float, default=1.0,
                        help="log-normal sigma of the lengths (the tail's weight)")
    parser.add_argument("--cap", type=int, default=2048, help="most new tokens of a group")
    parser.add_argument("--oversample", type=float, nargs="+", default=[1.5, 2.0])
    parser.add_argument("--max-staleness", type=int,
                        help="PartialRollouts' max_staleness (default: no bound)")
    parser.add_argument("--train-s", type=float, default=1.0, help="fixed training phase")
    parser.add_argument("--sleep-level", type=int, default=1, choices=[1, 2])
    parser.add_argument("--kv-cache-mib", type=int,
                        help="KV pool (default: every row in flight at full length fits)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1, help="the server's CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3,
                        help="run every mode this many times, in turn; keep each one's best")
    return parser.parse_args()


# ------------------------------------------------------------------------------ workload


def draw_groups(args: argparse.Namespace, vocab_size: int, num_groups: int) -> list[Group]:
    """The stream every mode draws from: random prompts, log-normal lengths, seeded samples."""
    rng = random.Random(args.seed)
    groups = []
    for i in range(num_groups):
        prompt_len = rng.randint(args.min_prompt_len, args.max_prompt_len)
        prompt = [rng.randrange(3, vocab_size) for _ in range(prompt_len)]
        num_tokens = round(math.exp(rng.gauss(math.log(args.median), args.sigma)))
        params = SamplingParams(n=args.n, temperature=1.0, ignore_eos=True,
                                max_tokens=min(max(num_tokens, 1), args.cap),
                                seed=args.seed * 1_000_003 + i)
        groups.append((f"g{i}", prompt, params))
    return groups


def num_groups_needed(args: argparse.Namespace) -> int:
    """Enough for the mode that takes most: every step's groups plus a full pool in flight."""
    return args.steps * args.num_groups + math.ceil(max(args.oversample) * args.num_groups)


# ------------------------------------------------------------------------- measurement


class GroupClock:
    """An EngineClient stand-in that notes, for each prompt of each `iter_completions` call,
    when the call started and when the prompt's last completion arrived; everything else goes
    to the client. PartialRollouts runs one call per group, the synchronous mode one per step."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.intervals: list[list[float]] = []
        """[start, end] per group, end = inf while it runs."""
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def iter_completions(self, prompts, sampling_params=None, timeout=None, cancel=None):
        start = time.perf_counter()
        params = (sampling_params if isinstance(sampling_params, Sequence)
                  else [sampling_params] * len(prompts))
        intervals = [[start, math.inf] for _ in prompts]
        num_left = [p.n for p in params]
        with self._lock:
            self.intervals += intervals
        for index, prompt_ids, completion in self.client.iter_completions(
            prompts, sampling_params, timeout=timeout, cancel=cancel
        ):
            num_left[index] -= 1
            if num_left[index] == 0:
                intervals[index][1] = time.perf_counter()
            yield index, prompt_ids, completion

    def idle_fraction(self, start: float, end: float) -> float:
        """1 - the time-average over [start, end] of the groups running / those in flight."""
        with self._lock:
            overlapping = [(a, b) for a, b in self.intervals if a < end and b > start]
        if not overlapping or end <= start:
            return 0.0
        busy_s = sum(min(b, end) - max(a, start) for a, b in overlapping)
        return 1.0 - busy_s / (len(overlapping) * (end - start))


@dataclass
class StepRecord:
    rollout_s: float
    step_s: float
    num_tokens: int
    num_stale_tokens: int
    """Returned tokens sampled by an older weight version than the engine's at return."""
    idle_fraction: float
    num_carried_over: int


def stale_tokens(groups: list[RolloutGroup], weight_version: int) -> int:
    return sum(g.num_tokens_older_than(weight_version) for g in groups)


def run_steps(client: EngineClient, weights, args: argparse.Namespace,
              rollout) -> list[StepRecord]:
    """`args.steps` training steps; `rollout(clock)` generates one step's groups and returns
    (groups, weight version at return, number carried over)."""
    colocation = Colocation(client, sleep_level=args.sleep_level, sleep_mode="keep")
    clock = GroupClock(client)
    records = []
    for _ in range(args.steps):
        step_start = time.perf_counter()
        with colocation.rollout(weights=weights):
            start = time.perf_counter()
            groups, weight_version, num_carried = rollout(clock)
            end = time.perf_counter()
        with colocation.training():
            time.sleep(args.train_s)
        records.append(StepRecord(
            end - start, time.perf_counter() - step_start, sum(g.num_tokens for g in groups),
            stale_tokens(groups, weight_version), clock.idle_fraction(start, end), num_carried))
    return records


def run_synchronous(client: EngineClient, weights, stream: Iterator[Group],
                    args: argparse.Namespace) -> list[StepRecord]:
    def rollout(clock: GroupClock):
        batch = [next(stream) for _ in range(args.num_groups)]
        keys = [key for key, _, _ in batch]
        outputs = {}
        for index, prompt_ids, completion in clock.iter_completions(
            [prompt for _, prompt, _ in batch], [params for _, _, params in batch]
        ):
            outputs.setdefault(index, []).append(completion)
        groups = [_group(keys[i], completions) for i, completions in sorted(outputs.items())]
        return groups, client.info().weight_version, 0

    return run_steps(client, weights, args, rollout)


def _group(key: str, completions) -> RolloutGroup:
    return RolloutGroup(key, RequestOutput(key, [], completions, None))


def run_partial(client: EngineClient, weights, stream: Iterator[Group],
                args: argparse.Namespace, oversample: float) -> list[StepRecord]:
    rollouts: list[PartialRollouts] = []

    def rollout(clock: GroupClock):
        if not rollouts:
            rollouts.append(PartialRollouts(clock, stream, SamplingParams(n=args.n),
                                            oversample=oversample,
                                            max_staleness=args.max_staleness))
        batch = rollouts[0].collect(args.num_groups)
        return batch.groups, batch.weight_version, batch.num_carried_over

    records = run_steps(client, weights, args, rollout)
    # What is still in flight (kept asleep) is thrown away before the next mode.
    client.wake_up()
    client.pause_generation("abort")
    rollouts[0].join(timeout_s=60)
    client.resume_generation()
    return records


# ------------------------------------------------------------------------------ report


@dataclass
class ModeSummary:
    name: str
    records: list[StepRecord]
    num_preemptions: int

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.records)

    @property
    def rollout_s(self) -> float:
        return sum(r.rollout_s for r in self.records)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.rollout_s

    @property
    def mean_step_s(self) -> float:
        return statistics.mean(r.step_s for r in self.records)

    @property
    def idle_fraction(self) -> float:
        return sum(r.idle_fraction * r.rollout_s for r in self.records) / self.rollout_s

    @property
    def off_policy_fraction(self) -> float:
        return sum(r.num_stale_tokens for r in self.records) / self.num_tokens


def print_workload(groups: list[Group], args: argparse.Namespace, threads: int) -> None:
    lengths = sorted(params.max_tokens for _, _, params in groups)
    print(f"workload: {args.num_groups} groups x n={args.n} per step, {args.steps} steps, "
          f"prompts {args.min_prompt_len}-{args.max_prompt_len} tokens, group lengths "
          f"log-normal (median {args.median:g}, sigma {args.sigma:g}, cap {args.cap}): drawn "
          f"median {statistics.median(lengths):.0f}, mean {statistics.mean(lengths):.0f}, "
          f"p90 {lengths[int(0.9 * len(lengths))]}, max {lengths[-1]}; train {args.train_s:g} s, "
          f"sleep level {args.sleep_level} keep, {args.size if not args.model else args.model}, "
          f"{threads} server thread(s)", flush=True)


def print_table(summaries: list[ModeSummary]) -> None:
    base = summaries[0]
    print("\n| mode | tokens returned | rollout (s) | rollout tokens/s | vs synchronous "
          "| mean step (s) | vs synchronous | idle fraction | off-policy tokens "
          "| groups carried over | rows recomputed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in summaries:
        speedup = s.tokens_per_s / base.tokens_per_s
        goal = ""
        if s.name == f"partial {GOAL_OVERSAMPLE:g}x":
            goal = f" (goal {GOAL_SPEEDUP}x: {'met' if speedup >= GOAL_SPEEDUP else 'missed'})"
        print(f"| {s.name} | {s.num_tokens} | {s.rollout_s:.2f} | {s.tokens_per_s:.0f} "
              f"| {speedup:.2f}x{goal} | {s.mean_step_s:.2f} | {s.mean_step_s / base.mean_step_s:.2f}x "
              f"| {s.idle_fraction:.2f} | {s.off_policy_fraction:.3f} "
              f"| {sum(r.num_carried_over for r in s.records)} | {s.num_preemptions} |")
    print("\nper step, rollout seconds (tokens):")
    for s in summaries:
        steps = ", ".join(f"{r.rollout_s:.2f} ({r.num_tokens})" for r in s.records)
        print(f"- {s.name}: {steps}")


def engine_options(args: argparse.Namespace, model_dir: str) -> dict:
    max_num_seqs = math.ceil(max(args.oversample) * args.num_groups) * args.n
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    kv_cache_bytes = (args.kv_cache_mib * MiB if args.kv_cache_mib else
                      max_num_seqs * (args.max_prompt_len + args.cap)
                      * kv_bytes_per_token(model_dir, getattr(torch, dtype)))
    return {
        "max_num_seqs": max_num_seqs,
        "kv_cache_bytes": kv_cache_bytes,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "device": args.device,
        "dtype": dtype,
        "cpu_threads": args.threads if args.device == "cpu" else None,
    }


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_model(
            Path(tmp) / "model", args.arch, args.size,
            max_position_embeddings=max(1024, args.cap + args.max_prompt_len)))
        from safetensors.torch import load_file
        from transformers import AutoConfig

        groups = draw_groups(args, AutoConfig.from_pretrained(model_dir).vocab_size,
                             num_groups_needed(args))
        print_workload(groups[: args.steps * args.num_groups], args, args.threads)
        weights = load_file(str(Path(model_dir) / "model.safetensors"))
        server = EngineServer(model_dir, engine_options=engine_options(args, model_dir),
                              log_path=Path(tmp) / "server.log")
        try:
            with EngineClient(server.address, timeout=600) as client:
                client.wait_until_ready(60)
                client.generate([groups[0][1]], SamplingParams(max_tokens=8))  # warm-up
                summaries = run_modes(client, weights, groups, args)
        finally:
            server.stop()
    print_table(summaries)


def run_modes(client: EngineClient, weights, groups: list[Group],
              args: argparse.Namespace) -> list[ModeSummary]:
    """Every mode `--rounds` times, rounds in turn; each mode's best round (highest rollout
    throughput): the machine's speed drifts, and a mode is not slowed by another's load."""
    modes = {"synchronous": lambda stream: run_synchronous(client, weights, stream, args)}
    for oversample in args.oversample:
        modes[f"partial {oversample:g}x"] = (
            lambda stream, o=oversample: run_partial(client, weights, stream, args, o))
    best: dict[str, ModeSummary] = {}
    for round_index in range(args.rounds):
        for name, run in modes.items():
            preemptions_before = client.info().engine_stats.get("num_preemptions", 0)
            records = run(iter(groups))
            num_preemptions = (client.info().engine_stats.get("num_preemptions", 0)
                               - preemptions_before)
            summary = ModeSummary(name, records, int(num_preemptions))
            print(f"round {round_index + 1}, {name}: {summary.tokens_per_s:.0f} tokens/s",
                  flush=True)
            if name not in best or summary.tokens_per_s > best[name].tokens_per_s:
                best[name] = summary
    return list(best.values())


if __name__ == "__main__":
    main()
