"""Sleep/wake latency of the engine next to the physical floor: memset and memcpy of the same bytes.

W = bytes of the weights pool, K = bytes of the KV pool. Each operation releases memory
and takes it back; the floor is the least work that takes, measured in the same run,
interleaved with the engine's operations, with the same torch threads:

| operation                                            | floor                      |
|------------------------------------------------------|----------------------------|
| sleep(level=1) + wake_up(): W to a host backup and   | 2 x memcpy(W) + memset(K)  |
|   back, K handed back zero-filled                    |                            |
| sleep(level=2) + wake_up(): W and K handed back      | memset(W + K)              |
|   zero-filled                                        |                            |
| release_kv_cache_memory() + wake_up(["kv_cache"])    | memset(K)                  |
| update_weights(every parameter), after level 2       | memcpy(W)                  |

"touched floor": memset/memcpy into resident memory (pure memory bandwidth); the goal is
a ratio of at most 1.5 against it. "fresh floor": the same into freshly allocated memory
(`torch.zeros`, `torch.empty(...).copy_`), i.e. what freeing and re-allocating tensors
costs; memory really given back to the OS has to be zeroed by the kernel again, so on
CPU this is the floor any release-and-reacquire can reach.

On CUDA (`--device cuda`) the floors are the same operations on the device (memset) and
between the device and pinned host memory (memcpy: the backup's direction), and the table
also gives the device bytes each release handed back, from `torch.cuda.mem_get_info`.

Then the pause, over gRPC against a `rollout-engine serve` process of the same model: while
a GRPO batch decodes (`--pause-prompts` x `--pause-n` samples at T=1, one group of it read as
a Generate stream), `pause_generation("keep")` is called at a random point of a decode step,
and the time until it returns (the engine is paused: no step runs after it) is measured;
then `resume_generation()` and the time until the stream's next token. Each is set against
the decode step time measured from the same stream just before. Goal: each within one decode
step; the token after a resume needs a step of its own, so there the goal is on the delay
beyond that step. Both with `clear_cache=False` (the KV stays) and `clear_cache=True` (the
default: the KV is dropped and recomputed at the resume, as a weight update needs).
`--skip-pause` leaves this part out.

    python -m benchmarks.sleep_wake                       # "small" model, 512 MiB KV pool
    python -m benchmarks.sleep_wake --kv-cache-mib 64 --repeats 3   # quick look
    python -m benchmarks.sleep_wake --device cuda --size 0.5b --kv-cache-mib 4096
    python -m benchmarks.sleep_wake --skip-pause        # the sleep/wake table only
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import add_model_args, kv_bytes_per_token, make_prompts
from rollout_engine import LLM, SamplingParams
from rollout_engine.protocol import EngineError
from rollout_engine.tiny_model import build_tiny_model
from rollout_engine.worker.weights.loader import iterate_checkpoint
from trainer_bridge import EngineClient
from trainer_bridge.server_process import EngineServer

MiB = 1 << 20
GOAL_RATIO = 1.5
Samples = dict[str, float]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, arch="llama")
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9, help="median of this many runs")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads; the work is memory-bound, and one thread avoids OpenMP stalls "
        "on a shared machine",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--skip-pause", action="store_true",
                        help="leave out the pause/resume latency (it starts a server)")
    parser.add_argument("--pause-prompts", type=int, default=8,
                        help="prompts of the GRPO batch decoding while pausing")
    parser.add_argument("--pause-n", type=int, default=8, help="samples per prompt")
    return parser.parse_args()


DEVICE = torch.device("cpu")


def timed_s(action: Callable[[], object]) -> float:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    start = time.perf_counter()
    action()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return time.perf_counter() - start


class Floors:
    """memset and memcpy of byte tensors of the pools' sizes, into resident or fresh memory.
    On CUDA memsets run on the device and memcpy goes device -> pinned host."""

    def __init__(self, weights_bytes: int, kv_bytes: int) -> None:
        self.w, self.k = weights_bytes, kv_bytes
        on_device = {"dtype": torch.uint8, "device": DEVICE}
        self.kv = torch.ones(kv_bytes, **on_device)
        self.both = torch.ones(weights_bytes + kv_bytes, **on_device)
        self.src = torch.ones(weights_bytes, **on_device)
        self.dst = torch.zeros(weights_bytes, dtype=torch.uint8,
                               pin_memory=DEVICE.type == "cuda")

    def sample(self) -> Samples:
        on_device = {"dtype": torch.uint8, "device": DEVICE}
        return {
            "memset(K)": timed_s(self.kv.zero_),
            "memset(W+K)": timed_s(self.both.zero_),
            "memcpy(W)": timed_s(lambda: self.dst.copy_(self.src)),
            "fresh memset(K)": timed_s(lambda: torch.zeros(self.k, **on_device)),
            "fresh memset(W+K)": timed_s(lambda: torch.zeros(self.w + self.k, **on_device)),
            "fresh memcpy(W)": timed_s(lambda: torch.empty_like(self.dst).copy_(self.src)),
        }


def sample_engine(llm: LLM, weights: dict[str, torch.Tensor]) -> Samples:
    """Seconds of each release and restore, once; the engine ends awake."""
    return {
        "level 1 release": timed_s(lambda: llm.sleep(level=1)),
        "level 1 restore": timed_s(llm.wake_up),
        "level 2 release": timed_s(lambda: llm.sleep(level=2)),
        "level 2 restore": timed_s(llm.wake_up),
        "update_weights restore": timed_s(lambda: llm.update_weights(weights)),
        "release_kv_cache_memory release": timed_s(llm.release_kv_cache_memory),
        "release_kv_cache_memory restore": timed_s(lambda: llm.wake_up(["kv_cache"])),
    }


def measure(llm: LLM, weights: dict[str, torch.Tensor], repeats: int) -> Samples:
    """Medians of engine operations and floors, interleaved so both see the same load."""
    pool_bytes = llm.memory_state().pool_bytes
    floors = Floors(pool_bytes["weights"], pool_bytes["kv_cache"])
    samples = [{**floors.sample(), **sample_engine(llm, weights)} for _ in range(repeats)]
    return {name: statistics.median(s[name] for s in samples) for name in samples[0]}


def floor_of(name: str, m: Samples, prefix: str) -> float:
    return {
        "level 1": 2 * m[f"{prefix}memcpy(W)"] + m[f"{prefix}memset(K)"],
        "level 2": m[f"{prefix}memset(W+K)"],
        "update_weights": m[f"{prefix}memcpy(W)"],
        "release_kv_cache_memory": m[f"{prefix}memset(K)"],
    }[name]


FLOOR_LABELS = {
    "level 1": "2 x memcpy(W) + memset(K)",
    "level 2": "memset(W+K)",
    "update_weights": "memcpy(W)",
    "release_kv_cache_memory": "memset(K)",
}


def print_table(m: Samples, w: int, k: int) -> None:
    print(f"\nW = {w / MiB:.1f} MiB of weights, K = {k / MiB:.1f} MiB of KV cache, "
          f"{torch.get_num_threads()} torch thread(s), medians\n")
    print("| operation | release (ms) | restore (ms) | total (ms) | floor | touched floor (ms) "
          "| ratio | fresh floor (ms) | ratio |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for name, label in FLOOR_LABELS.items():
        release_s = m.get(f"{name} release", 0.0)
        total_s = release_s + m[f"{name} restore"]
        touched_s, fresh_s = floor_of(name, m, ""), floor_of(name, m, "fresh ")
        verdict = "met" if total_s <= GOAL_RATIO * touched_s else "missed"
        release = f"{release_s * 1e3:.1f}" if f"{name} release" in m else "-"
        print(f"| {name} | {release} | {m[f'{name} restore'] * 1e3:.1f} | {total_s * 1e3:.1f} "
              f"| {label} | {touched_s * 1e3:.1f} | {total_s / touched_s:.2f}x "
              f"(<= {GOAL_RATIO}x {verdict}) | {fresh_s * 1e3:.1f} | {total_s / fresh_s:.2f}x |")


def device_bytes_freed(llm: LLM) -> dict[str, int]:
    """Device bytes each release hands back, from the driver's free-memory count (CUDA)."""
    def freed(release: Callable[[], object], restore: Callable[[], object]) -> int:
        free_before, _ = torch.cuda.mem_get_info(DEVICE)
        release()
        free_after, _ = torch.cuda.mem_get_info(DEVICE)
        restore()
        return free_after - free_before

    return {
        "level 1": freed(lambda: llm.sleep(level=1), llm.wake_up),
        "release_kv_cache_memory": freed(llm.release_kv_cache_memory,
                                         lambda: llm.wake_up(["kv_cache"])),
    }


# --------------------------------------------------------------------------- pause / resume

PAUSE_GAP_STEPS = 8
"""Decode steps between two pauses: the step time is measured over them."""
TOKENS_PER_CYCLE = PAUSE_GAP_STEPS + 16
"""Tokens a stream may take per pause cycle (steps of the KV recompute included)."""
WIRE_GRACE_S = 0.02
"""A step's output may reach the client just after the pause's reply: not a leak."""


class ProbeStream:
    """One prompt's samples read as a Generate stream on a thread: when each step's tokens
    arrived, as (time, decode steps so far)."""

    def __init__(self, client: EngineClient, prompt: list[int], params: SamplingParams) -> None:
        self.arrivals: list[tuple[float, int]] = []
        self.is_done = False
        self._n = params.n
        self._changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(client, prompt, params),
                                       daemon=True)
        self.thread.start()

    def _read(self, client: EngineClient, prompt: list[int], params: SamplingParams) -> None:
        try:
            for snapshot in client.generate_stream(prompt, params):
                num_tokens = sum(len(c.token_ids) for c in snapshot.outputs)
                with self._changed:
                    self.arrivals.append((time.perf_counter(), num_tokens // self._n))
                    self._changed.notify_all()
        except EngineError:
            pass  # aborted at the end
        finally:
            with self._changed:
                self.is_done = True
                self._changed.notify_all()

    def num_steps(self) -> int:
        with self._changed:
            return self.arrivals[-1][1] if self.arrivals else 0

    def wait(self, is_reached: Callable[[tuple[float, int]], bool]) -> tuple[float, int]:
        """The first arrival from now on (or the last one) for which `is_reached` holds."""
        with self._changed:
            self._changed.wait_for(
                lambda: self.is_done or (self.arrivals and is_reached(self.arrivals[-1])), 600)
            assert self.arrivals and is_reached(self.arrivals[-1]), (
                f"the stream ended or stalled at {self.arrivals[-1:]}: fewer --repeats")
            return self.arrivals[-1]

    def wait_steps(self, num_steps: int) -> tuple[float, int]:
        target = self.num_steps() + num_steps
        return self.wait(lambda arrival: arrival[1] >= target)

    def steps_between(self, start: float, end: float) -> int:
        with self._changed:
            until_end = [num for t, num in self.arrivals if t < end]
            until_start = [num for t, num in self.arrivals if t <= start]
        return (until_end[-1] if until_end else 0) - (until_start[-1] if until_start else 0)


def pause_cycle(client: EngineClient, head: ProbeStream, tail: ProbeStream, clear_cache: bool,
                rng: random.Random) -> Samples:
    """Decode steps to time the step, a pause at a random point of a step, a hold, a resume.
    `head` is the batch's first prompt in the engine's queue, `tail` its last: after a resume
    with clear_cache, the KV is recomputed in queue order."""
    tail.wait_steps(2)  # the whole batch decodes (past the recompute of a previous cycle)
    first_t, first_steps = head.wait_steps(1)
    last_t, last_steps = head.wait_steps(PAUSE_GAP_STEPS)
    step_s = (last_t - first_t) / (last_steps - first_steps)
    time.sleep(rng.uniform(0.0, step_s))
    start = time.perf_counter()
    client.pause_generation("keep", clear_cache=clear_cache)
    paused = time.perf_counter()
    time.sleep(max(0.05, 3 * step_s))
    resume = time.perf_counter()
    steps_while_paused = head.steps_between(paused + WIRE_GRACE_S, resume)
    client.resume_generation()
    next_t, _ = head.wait(lambda arrival: arrival[0] > resume)
    batch_t, _ = tail.wait(lambda arrival: arrival[0] > resume)
    return {"pause": paused - start, "resume": next_t - resume, "batch": batch_t - resume,
            "step": step_s, "steps while paused": steps_while_paused}


def start_batch(client: EngineClient, prompts: list[list[int]], params: SamplingParams
                ) -> tuple[ProbeStream, ProbeStream, threading.Thread]:
    """The GRPO batch, in the engine's queue in this order: a stream of prompts[0], one
    GenerateBatch call of the others but the last, a stream of the last."""
    head = ProbeStream(client, prompts[0], params)
    head.wait_steps(1)
    batch = threading.Thread(target=_generate_quietly, args=(client, prompts[1:-1], params),
                             daemon=True)
    batch.start()
    while client.info().num_unfinished_requests < len(prompts) - 1:
        time.sleep(0.002)
    return head, ProbeStream(client, prompts[-1], params), batch


def measure_pause(model_dir: str, args: argparse.Namespace) -> dict[bool, list[Samples]]:
    """Pause/resume cycles against a served engine, alternating clear_cache False and True."""
    on_cpu = DEVICE.type == "cpu"
    workload = argparse.Namespace(num_prompts=args.pause_prompts, min_prompt_len=64,
                                  max_prompt_len=256, seed=0)
    dtype = torch.float32 if on_cpu else torch.bfloat16
    max_tokens = (2 * args.repeats + 1) * TOKENS_PER_CYCLE + 32
    # A pool the whole batch fits in (no preemption), whatever --kv-cache-mib says.
    num_tokens = args.pause_prompts * args.pause_n * (workload.max_prompt_len + max_tokens)
    options = {"kv_cache_bytes": num_tokens * kv_bytes_per_token(model_dir, dtype),
               "device": args.device, "dtype": str(dtype).removeprefix("torch."),
               "cpu_threads": args.threads if on_cpu else None}
    rng = random.Random(0)
    server = EngineServer(model_dir, engine_options=options)
    try:
        with EngineClient(server.address, timeout=600) as client:
            client.wait_until_ready(60)
            info = client.info()
            params = SamplingParams(
                n=args.pause_n, temperature=1.0, ignore_eos=True, seed=0,
                max_tokens=min(max_tokens, info.max_model_len - workload.max_prompt_len))
            head, tail, batch = start_batch(client, make_prompts(workload, info.vocab_size),
                                            params)
            pause_cycle(client, head, tail, False, rng)  # warm-up
            cycles: dict[bool, list[Samples]] = {False: [], True: []}
            for _ in range(args.repeats):
                for clear_cache in (False, True):
                    cycles[clear_cache].append(pause_cycle(client, head, tail, clear_cache, rng))
            client.pause_generation("abort")
            for thread in (batch, head.thread, tail.thread):
                thread.join(60)
            client.resume_generation()
    finally:
        server.stop()
    return cycles


def _generate_quietly(client: EngineClient, prompts, params: SamplingParams) -> None:
    try:
        client.generate(prompts, params)
    except EngineError:
        pass  # aborted at the end


def median_and_max(samples: list[Samples], name: str, minus_s: float = 0.0
                   ) -> tuple[float, float]:
    values = [s[name] - minus_s for s in samples]
    return statistics.median(values), max(values)


def print_pause_table(cycles: dict[bool, list[Samples]], args: argparse.Namespace) -> None:
    print(f"\npause / resume over gRPC while {args.pause_prompts} prompts x n={args.pause_n} "
          f"decode (prompts 64-256 tokens, T=1), {len(cycles[False])} cycles each, "
          f"median (max)\n")
    print("| pause_generation(\"keep\") | decode step (ms) | pause -> paused (ms) | / step "
          "| resume -> next token (ms) | / step | beyond the token's own step / step "
          "| resume -> whole batch decoding (ms) | / step | steps while paused |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for clear_cache, samples in cycles.items():
        step_s = statistics.median(s["step"] for s in samples)
        pause, resume = median_and_max(samples, "pause"), median_and_max(samples, "resume")
        batch = median_and_max(samples, "batch")
        beyond = (resume[0] - step_s) / step_s
        print(f"| clear_cache={clear_cache} | {step_s * 1e3:.1f} "
              f"| {pause[0] * 1e3:.1f} ({pause[1] * 1e3:.1f}) "
              f"| {pause[0] / step_s:.2f} (<= 1 {'met' if pause[0] <= step_s else 'missed'}) "
              f"| {resume[0] * 1e3:.1f} ({resume[1] * 1e3:.1f}) | {resume[0] / step_s:.2f} "
              f"| {beyond:.2f} (<= 1 {'met' if beyond <= 1 else 'missed'}) "
              f"| {batch[0] * 1e3:.1f} ({batch[1] * 1e3:.1f}) | {batch[0] / step_s:.2f} "
              f"| {max(s['steps while paused'] for s in samples)} |")


def measure_sleep_wake(model_dir: str, args: argparse.Namespace) -> None:
    """The sleep/wake table (and on CUDA the device bytes freed), in process."""
    dtype = "float32" if DEVICE.type == "cpu" else "bfloat16"
    llm = LLM(model_dir, kv_cache_bytes=args.kv_cache_mib * MiB, device=args.device,
              dtype=dtype)
    # The checkpoint in process memory (as a trainer holds it), to restore after level 2.
    weights = {name: t.to(getattr(torch, dtype)).clone()
               for name, t in iterate_checkpoint(model_dir)}
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    sample_engine(llm, weights)  # warm-up of the memory paths
    medians = measure(llm, weights, args.repeats)
    pool_bytes = llm.memory_state().pool_bytes
    print_table(medians, pool_bytes["weights"], pool_bytes["kv_cache"])
    if DEVICE.type == "cuda":
        print("\n| release | pool bytes | device bytes freed (mem_get_info) | freed / pool |")
        print("|---|---:|---:|---:|")
        pools = {"level 1": pool_bytes["weights"] + pool_bytes["kv_cache"],
                 "release_kv_cache_memory": pool_bytes["kv_cache"]}
        for name, freed in device_bytes_freed(llm).items():
            print(f"| {name} | {pools[name] / MiB:.1f} MiB | {freed / MiB:.1f} MiB "
                  f"| {freed / pools[name]:.3f} |")
    llm.shutdown()  # its memory back before the server of the pause measurement starts


def main() -> None:
    global DEVICE
    args = parse_args()
    DEVICE = torch.device(args.device)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_model(Path(tmp) / "model", args.arch, args.size))
        measure_sleep_wake(model_dir, args)
        if not args.skip_pause:
            print_pause_table(measure_pause(model_dir, args), args)


if __name__ == "__main__":
    main()
