"""Load: 32 client threads against one server for a bounded time, mixing generation, early
cancels, tiny deadlines, sleep/wake and weight updates. Nothing may deadlock, every call ends
with a result or the status its situation calls for, and afterwards nothing is in flight,
every KV block is free, resident memory is bounded and greedy output matches the oracle.

`make test` runs it for a few seconds; `ROLLOUT_LOAD_S=120 pytest tests/e2e/test_load.py -s`
runs it longer and prints the outcome table recorded in docs/RELIABILITY.md."""

from __future__ import annotations

import collections
import functools
import os
import random
import threading
import time
from collections.abc import Callable

import pytest
from safetensors.torch import load_file

from memory import process_rss_bytes
from rollout_engine.protocol import EngineError
from tests.e2e.server_process import start_server
from tests.integration.hf_oracle import hf_greedy_batch
from trainer_bridge import EngineClient, SamplingParams

NUM_THREADS = 32
DURATION_S = float(os.environ.get("ROLLOUT_LOAD_S", "12"))
SLOW_DURATION_S = 90.0
CALL_TIMEOUT_S = 120.0  # far above any legitimate call: hitting it means a deadlock
RSS_GROWTH_LIMIT_BYTES = 200 * 1024**2
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ORACLE_PROMPTS = [[5 + i, 17, 99, 250, 7, 31, 64, 128] for i in range(4)]

# The statuses each kind of call may end with while others sleep, wake and update the engine.
_SLEEPING_OR_BUSY = {"FAILED_PRECONDITION"}
ALLOWED = {
    "generate": _SLEEPING_OR_BUSY | {"RESOURCE_EXHAUSTED"},
    "stream_cancel": _SLEEPING_OR_BUSY | {"RESOURCE_EXHAUSTED"},
    "tiny_deadline": _SLEEPING_OR_BUSY | {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"},
    "sleep_wake": set(),
    "release_kv": set(),
    # A concurrent update may supersede this one (INVALID_ARGUMENT: "superseded"/"closed").
    "update_weights": _SLEEPING_OR_BUSY | {"INVALID_ARGUMENT"},
    "rl_cycle": _SLEEPING_OR_BUSY | {"INVALID_ARGUMENT"},
    "info": set(),
}


@pytest.fixture(scope="module")
def load_server(tmp_path_factory, llama_dir):
    process = start_server(tmp_path_factory, llama_dir, "--max-inflight-requests", "256",
                           "--num-speculative-tokens", "2")
    yield process
    assert process.stop() == 0, process.log()[-3000:]


class LoadRun:
    """The threads' shared bookkeeping: outcomes per action, and unexpected failures."""

    def __init__(self, client: EngineClient, weights: dict) -> None:
        self.client = client
        self.weights = weights
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.failures: list[str] = []
        self.lock = threading.Lock()

    def record(self, action: str, call: Callable[[], object]) -> None:
        try:
            call()
            outcome = "ok"
        except EngineError as exc:
            outcome = exc.code
            if outcome not in ALLOWED[action] or (
                outcome == "INVALID_ARGUMENT" and not any(
                    word in str(exc) for word in ("superseded", "closed"))
            ):
                with self.lock:
                    self.failures.append(f"{action}: {type(exc).__name__}: {exc}")
        with self.lock:
            self.outcomes[(action, outcome)] += 1

    # ------------------------------------------------------------------------ actions
    def generate(self, rng: random.Random) -> None:
        prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 40))]
                   for _ in range(rng.randint(1, 3))]
        params = SamplingParams(n=rng.randint(1, 4), temperature=rng.choice([0.0, 1.0]),
                                max_tokens=rng.randint(1, 24), seed=rng.randrange(100))
        outputs = self.client.generate(prompts, params, timeout=CALL_TIMEOUT_S)
        assert len(outputs) == len(prompts)
        assert all(c.finish_reason in ("stop", "length", "abort") for o in outputs
                   for c in o.outputs)

    def stream_cancel(self, rng: random.Random) -> None:
        stream = self.client.generate_stream([rng.randrange(3, 500) for _ in range(8)],
                                             SamplingParams(max_tokens=64, ignore_eos=True),
                                             timeout=CALL_TIMEOUT_S)
        for _ in range(rng.randint(1, 3)):
            if next(stream, None) is None:
                break
        stream.close()

    def tiny_deadline(self, rng: random.Random) -> None:
        self.client.generate([[5, 6, 7]], SamplingParams(max_tokens=32, ignore_eos=True),
                             timeout=rng.uniform(0.005, 0.2))

    def sleep_wake(self, rng: random.Random) -> None:
        self.client.sleep(level=1, mode=rng.choice(["abort", "wait"]))
        time.sleep(rng.uniform(0.0, 0.1))
        self.client.wake_up()

    def release_kv(self, rng: random.Random) -> None:
        self.client.release_kv_cache_memory()
        self.client.wake_up(["kv_cache"])

    def update_weights(self, rng: random.Random) -> None:
        transport = rng.choice(["stream", "shm"])
        self.client.update_weights(self.weights, transport=transport, timeout=CALL_TIMEOUT_S)

    def rl_cycle(self, rng: random.Random) -> None:
        """The colocation step: sleep (generation ends), wake the weights, push, wake KV."""
        self.client.sleep(level=2, mode=rng.choice(["abort", "wait"]))
        self.client.wake_up(["weights"])
        self.client.update_weights(self.weights, transport=rng.choice(["stream", "shm"]),
                                   timeout=CALL_TIMEOUT_S)
        self.client.wake_up(["kv_cache"])

    def info(self, rng: random.Random) -> None:
        self.client.info()
        self.client.memory_state()


# 30 threads generate; one puts the engine to sleep and wakes it, one pushes weights, each
# every few tenths of a second, so generation is served most of the time and disturbed often.
CLIENT_ACTIONS = ["generate"] * 6 + ["stream_cancel"] * 2 + ["tiny_deadline"] * 2 + ["info"]
ROLES = {0: ["sleep_wake", "release_kv"], 1: ["update_weights", "rl_cycle"]}


def worker(run: LoadRun, seed: int, deadline_s: float) -> None:
    rng = random.Random(seed)
    actions = ROLES.get(seed, CLIENT_ACTIONS)
    while time.monotonic() < deadline_s:
        action = rng.choice(actions)
        run.record(action, functools.partial(getattr(run, action), rng))
        if seed in ROLES:
            time.sleep(rng.uniform(0.1, 0.5))


def restore(client: EngineClient, weights: dict) -> None:
    """Wake everything and land one complete update (retrying while another thread's work
    drains), so the engine serves the checkpoint again."""
    for _ in range(50):
        try:
            client.wake_up()
            client.update_weights(weights, transport="stream")
            return
        except EngineError:
            time.sleep(0.1)
    raise AssertionError("could not restore the engine after the load")


@pytest.mark.parametrize(
    "duration_s", [DURATION_S, pytest.param(SLOW_DURATION_S, marks=pytest.mark.slow)],
    ids=["short", "long"],
)
def test_load_holds(load_server, llama_dir, duration_s):
    weights = load_file(str(llama_dir / "model.safetensors"))
    oracle = hf_greedy_batch(str(llama_dir), ORACLE_PROMPTS, GREEDY.max_tokens)
    with EngineClient(load_server.address, timeout=CALL_TIMEOUT_S) as client:
        client.wait_until_ready(30)
        client.generate(ORACLE_PROMPTS, GREEDY)  # warm-up
        rss_before = process_rss_bytes(load_server.process.pid)
        run = LoadRun(client, weights)
        deadline_s = time.monotonic() + duration_s
        threads = [threading.Thread(target=worker, args=(run, seed, deadline_s), daemon=True)
                   for seed in range(NUM_THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(duration_s + 2 * CALL_TIMEOUT_S)
        assert not any(t.is_alive() for t in threads), "a call never returned"
        restore(client, weights)
        rss_growth = process_rss_bytes(load_server.process.pid) - rss_before
        info = client.info()
        print_outcomes(run.outcomes, rss_growth, duration_s)
        assert not run.failures, run.failures[:10]
        assert info.num_inflight_requests == 0 and info.num_unfinished_requests == 0
        assert info.num_free_blocks == info.num_blocks
        assert rss_growth < RSS_GROWTH_LIMIT_BYTES, rss_growth
        assert [o.outputs[0].token_ids for o in client.generate(ORACLE_PROMPTS, GREEDY)] == oracle
        assert sum(count for (_, outcome), count in run.outcomes.items() if outcome == "ok") > 0


def print_outcomes(outcomes: collections.Counter, rss_growth: int, duration_s: float) -> None:
    actions = sorted({action for action, _ in outcomes})
    print(f"\nload: {NUM_THREADS} threads x {duration_s:.0f} s, "
          f"{sum(outcomes.values())} calls, server RSS growth {rss_growth / 2**20:.1f} MiB")
    for action in actions:
        row = {o: c for (a, o), c in outcomes.items() if a == action}
        print(f"  {action:15s} " + ", ".join(f"{o}={c}" for o, c in sorted(row.items())))
