"""The served engine's OpenMP workers keep spinning between parallel regions.

With more OpenMP workers in a process than cores, libgomp's workers sleep and are woken at
every barrier instead of spinning: hundreds of context switches a decode step, and a served
rollout 20-30% slower on a 2-core machine. The server loads its engine on a thread that exits
and keeps its event-loop thread at one thread (`cli._build_engine_off_this_thread`), so the
engine thread's workers are the only ones. On a machine with many cores the workers never
oversubscribe them and this holds trivially.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rollout_engine import SamplingParams
from rollout_engine.tiny_model import build_tiny_model
from rollout_engine.worker.cpu_threads import cpu_seconds
from tests.e2e.server_process import start_server
from trainer_bridge import EngineClient

MAX_TOKENS = 12


def _threads(pid: int) -> dict[str, tuple[float, int]]:
    """Per thread of `pid`: CPU seconds and voluntary context switches so far."""
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            seconds = cpu_seconds(task / "stat")
            status = (task / "status").read_text()
        except OSError:  # the thread ended
            continue
        switches = next(int(line.split()[1]) for line in status.splitlines()
                        if line.startswith("voluntary_ctxt_switches"))
        threads[task.name] = (seconds, switches)
    return threads


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_the_engine_threads_do_not_sleep_at_every_barrier(tmp_path_factory):
    model_dir = build_tiny_model(
        tmp_path_factory.mktemp("small") / "qwen2", "qwen2", "small", num_hidden_layers=2
    )
    server = start_server(tmp_path_factory, model_dir, "--kv-cache-bytes", str(256 * 1024**2))
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 8000) for _ in range(100)] for _ in range(6)]
        params = SamplingParams(n=8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=0)
        with EngineClient(server.address, timeout=120) as client:
            client.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
            before = _threads(server.process.pid)
            client.generate(prompts, params)
            after = _threads(server.process.pid)
        used = sorted(
            ((after[t][0] - before[t][0], after[t][1] - before[t][1]) for t in after if t in before),
            reverse=True,
        )
        # The engine thread and its OpenMP worker do the work; gRPC's threads wake per message.
        switches = sum(count for _, count in used[:2])
        assert switches < 20 * MAX_TOKENS, f"busiest threads (CPU s, switches): {used[:4]}"
    finally:
        assert server.stop() == 0, server.log()[-3000:]
