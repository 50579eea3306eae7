"""EnginePool: several real servers behind one client. Groups stay on one engine, prompts
sharing a prefix meet on one engine, an engine killed mid-rollout costs nothing but time,
and a restarted engine rejoins once it holds the pool's weights; TRL trains through a pool.

Seeded sampling is the oracle: a seeded request's tokens depend on its seed, prompt and
parameters only, so every engine, and the in-process reference, must give the same ones.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import pytest

from rollout_engine.worker.weights.loader import iterate_checkpoint
from tests.e2e.server_process import ENGINE_OPTIONS
from trainer_bridge import DeadlineExceededError, EngineClient, SamplingParams
from trainer_bridge.engine_pool import EnginePool
from trainer_bridge.server_process import EngineServer

_rng = random.Random(11)
PREFIX = [_rng.randrange(3, 500) for _ in range(64)]
DISTINCT = [[_rng.randrange(3, 500) for _ in range(_rng.randint(8, 40))] for _ in range(9)]
SHARING = [PREFIX + [_rng.randrange(3, 500) for _ in range(5)] for _ in range(3)]
PROMPTS = DISTINCT + SHARING
PARAMS = SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=5, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(llama_dir, tmp_path, name: str, env: dict | None = None) -> EngineServer:
    return EngineServer(llama_dir, port=free_port(), engine_options=ENGINE_OPTIONS,
                        log_path=tmp_path / f"{name}.log", env=env)


@pytest.fixture(scope="module")
def expected(llama_dir):
    from rollout_engine import LLM

    llm = LLM(str(llama_dir), **ENGINE_OPTIONS)
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, PARAMS)]


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


# Five server starts (37 s). The fast suite keeps a pool's engine killed between calls
# (test_ray_engines) and a lone engine killed mid-rollout (test_trl_backend).
@pytest.mark.slow
def test_a_pool_of_three_loses_nothing_when_an_engine_dies_and_takes_it_back(
    llama_dir, tmp_path, expected
):
    trigger = tmp_path / "hang-now"  # the fault fires only while this file exists
    trigger.touch()
    hang = {"ROLLOUT_ENGINE_FAULT_INJECTION": json.dumps(
        {"when": "decode", "error": "hang", "hang_s": 60, "skip": 2, "times": 1,
         "trigger_file": str(trigger)})}
    servers = [start(llama_dir, tmp_path, "a"), start(llama_dir, tmp_path, "b", env=hang),
               start(llama_dir, tmp_path, "c")]
    doomed = servers[1]
    try:
        with EnginePool([s.address for s in servers], timeout=60, probe_interval_s=0.0) as pool:
            def kill_when_stuck() -> None:  # b hangs in a decode step: kill it there
                with EngineClient(doomed.address, timeout=1, max_retries=0) as watcher:
                    while True:
                        try:
                            if watcher.info().num_inflight_requests:
                                break
                        except DeadlineExceededError:
                            break  # its engine thread is already stuck in the step
                        time.sleep(0.01)
                time.sleep(0.3)
                doomed.kill()

            killer = threading.Thread(target=kill_when_stuck, daemon=True)
            killer.start()
            outputs = pool.generate(PROMPTS, PARAMS)
            killer.join(30)
            assert tokens(outputs) == expected  # every prompt answered, every group whole
            assert not doomed.is_running
            assert doomed.address not in pool.live_addresses
            assert doomed.address not in pool.last_assignment.values()
            # Prompts sharing a 64-token prefix met on one engine; the rest were spread.
            assert len({pool.last_assignment[i] for i in range(9, 12)}) == 1
            assert set(pool.last_assignment.values()) == {servers[0].address, servers[2].address}

            trigger.unlink()
            doomed.restart()  # same port, fresh process, weights of the checkpoint (version 0)
            EngineClient(doomed.address).wait_until_ready(30)
            assert tokens(pool.generate(PROMPTS, PARAMS)) == expected
            assert doomed.address in pool.live_addresses  # rejoined: no weights were pushed
            assert doomed.address in pool.last_assignment.values()

            weights = list(iterate_checkpoint(str(llama_dir)))
            assert pool.update_weights(weights) == 1  # every engine at version 1 now
            servers[2].restart()  # back at version 0: it must not serve until updated
            EngineClient(servers[2].address).wait_until_ready(30)
            assert tokens(pool.generate(PROMPTS, PARAMS)) == expected
            assert servers[2].address in pool.live_addresses
            assert servers[2].address not in pool.last_assignment.values()
            pool.update_weights(weights)
            assert tokens(pool.generate(PROMPTS, PARAMS)) == expected
            assert servers[2].address in pool.last_assignment.values()
    finally:
        for server in servers:
            server.kill()


@pytest.mark.slow  # two servers and two GRPO steps; the pool itself is tested above
def test_trl_trains_through_a_pool(llama_dir, tmp_path):
    from tests.e2e.test_trl_backend import make_trainer

    servers = [start(llama_dir, tmp_path, "p"), start(llama_dir, tmp_path, "q")]
    try:
        with EnginePool([s.address for s in servers], timeout=60) as pool:
            trainer = make_trainer(llama_dir, tmp_path, pool)
            trainer.train()
            first = next(h for h in trainer.state.log_history if "reward" in h)
            for key in ("min", "mean", "max"):
                assert first[f"sampling/importance_sampling_ratio/{key}"] == pytest.approx(
                    1.0, abs=1e-3)
            # Both engines received every weight push, and both generated.
            for server in servers:
                with EngineClient(server.address, timeout=30) as client:
                    assert client.info().weight_version == 2
            assert len(set(pool.last_assignment.values())) == 2
    finally:
        for server in servers:
            server.kill()
