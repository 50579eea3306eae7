"""Soak: 1,000 colocation cycles (sleep, wake, weight push, generate) over gRPC against one
server: its private resident memory grows by less than 0.5% in either half of them (a leak
grows in both; see tests/memory_growth.py), and no file descriptor or thread leaks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tqdm.auto import tqdm

from tests.e2e.server_process import start_server
from tests.memory_growth import leak_bytes, private_rss_bytes
from trainer_bridge import EngineClient, SamplingParams

NUM_CYCLES = 1000
# Warm-up fills what is bounded but not preallocated: the engine's memory event log (10,000
# events, about 10 a cycle) and the allocators' free lists. Measured: +7.5 MiB over the first
# 500 cycles, then +0.9 MiB over the next 2,500.
NUM_WARMUP_CYCLES = 1000
PROMPT = [5, 17, 99, 250, 7, 31, 64, 128]


def num_open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def num_threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def cycle(client: EngineClient, weights: dict, index: int) -> list[int]:
    client.sleep(level=2 if index % 2 else 1)
    client.wake_up(["weights"])
    client.update_weights(weights, transport="shm" if index % 3 else "stream")
    client.wake_up(["kv_cache"])
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return client.generate([PROMPT], greedy)[0].outputs[0].token_ids


@pytest.mark.slow
def test_a_thousand_cycles_leak_nothing(tmp_path_factory, llama_dir: Path):
    server = start_server(tmp_path_factory, llama_dir)
    pid = server.process.pid
    weights = load_file(str(llama_dir / "model.safetensors"))
    try:
        with EngineClient(server.address, timeout=60) as client:
            client.wait_until_ready(30)
            warmup = tqdm(range(NUM_WARMUP_CYCLES), desc="warm-up", unit="cycle")
            expected = [cycle(client, weights, i) for i in warmup][-1]
            rss = [private_rss_bytes(pid)]
            fds_before, threads_before = num_open_fds(pid), num_threads(pid)
            for i in tqdm(range(NUM_CYCLES), desc="soak", unit="cycle"):
                assert cycle(client, weights, i) == expected
                if i + 1 in (NUM_CYCLES // 2, NUM_CYCLES):
                    rss.append(private_rss_bytes(pid))
            fds_after, threads_after = num_open_fds(pid), num_threads(pid)
            print(f"\nsoak: {NUM_CYCLES} cycles, server private RSS "
                  f"{' -> '.join(f'{b / 2**20:.1f}' for b in rss)} MiB, fds {fds_before} -> "
                  f"{fds_after}, threads {threads_before} -> {threads_after}")
            assert leak_bytes(rss) < 0.005 * rss[0], rss
            assert fds_after <= fds_before and threads_after <= threads_before
            assert client.info().weight_version == NUM_WARMUP_CYCLES + NUM_CYCLES
    finally:
        assert server.stop() == 0, server.log()[-3000:]
