"""`rollout-engine serve --tensor-parallel-size 2`: the same completions as one process,
weights pushed over gRPC land on both ranks, and SIGTERM stops the other rank too."""

from __future__ import annotations

import os
import time

import pytest
from safetensors.torch import load_file

from rollout_engine import LLM
from rollout_engine import SamplingParams as EngineSamplingParams
from tests.e2e.server_process import ENGINE_OPTIONS, start_server
from trainer_bridge import EngineClient, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 42], list(range(20, 40))]
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def child_pids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


# Slow (about 30 s: two rank processes): the fast suite covers TP in one process
# (tests/integration/test_tensor_parallel.py), and the fresh-clone suite stays under 10 minutes.
@pytest.mark.slow
def test_served_tp2_generates_updates_weights_and_stops_its_ranks(tmp_path_factory, llama_dir):
    server = start_server(
        tmp_path_factory, llama_dir, "--tensor-parallel-size", "2", "--cpu-threads", "1"
    )
    try:
        ranks = child_pids(server.process.pid)  # rank 1 (and spawn's resource tracker)
        assert ranks, "the server started no rank process"
        local = LLM(str(llama_dir), **ENGINE_OPTIONS).generate(
            PROMPTS, EngineSamplingParams(**GREEDY)
        )
        with EngineClient(server.address, timeout=60) as client:
            client.wait_until_ready(30)
            remote = client.generate(PROMPTS, SamplingParams(**GREEDY))
            assert [r.outputs[0].token_ids for r in remote] == [
                r.outputs[0].token_ids for r in local
            ]
            client.sleep(level=2)
            client.wake_up(["weights"])
            client.update_weights(load_file(str(llama_dir / "model.safetensors")))
            client.wake_up(["kv_cache"])
            again = client.generate(PROMPTS, SamplingParams(**GREEDY))
            assert [r.outputs[0].token_ids for r in again] == [
                r.outputs[0].token_ids for r in local
            ]
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in ranks)
