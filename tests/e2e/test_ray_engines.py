"""Ray placement on a local cluster: two engine servers as actors in a placement group, one
pool over them; an engine killed under the pool costs nothing but a retry elsewhere."""

from __future__ import annotations

import os

import pytest
import ray

from tests.e2e.server_process import ENGINE_OPTIONS
from tests.e2e.test_engine_pool import PARAMS, PROMPTS, tokens


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_two_engine_actors_serve_one_pool_and_survive_one_death(ray_cluster, llama_dir, expected):
    from trainer_bridge.ray_engines import start_engines

    with start_engines(str(llama_dir), 2, engine_options=ENGINE_OPTIONS, timeout=60) as engines:
        pool = engines.pool
        assert len(pool.live_addresses) == 2
        assert tokens(pool.generate(PROMPTS, PARAMS)) == expected
        assert len(set(pool.last_assignment.values())) == 2  # both actors' servers worked
        ray.get(engines.actors[0].kill_server.remote())
        assert tokens(pool.generate(PROMPTS, PARAMS)) == expected
        assert pool.live_addresses == [ray.get(engines.actors[1].address.remote())]
        pid = ray.get(engines.actors[1].pid.remote())
    with pytest.raises(ProcessLookupError):  # shutdown stopped the servers
        os.kill(pid, 0)


@pytest.fixture(scope="module")
def expected(llama_dir):
    from rollout_engine import LLM

    llm = LLM(str(llama_dir), **ENGINE_OPTIONS)
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, PARAMS)]
