"""EnginePool against two real servers, one behind a TCP proxy the test cuts: an engine that
missed a weight push (unreachable during it, or cut off half-way through it) never serves the
old policy when it answers again, and one engine's error settles every engine's call.

Seeded sampling is the oracle: a seeded request's tokens depend on its seed, prompt,
parameters and weights only, so the engine that holds the latest weights, asked directly,
gives the tokens every pooled answer must carry.
"""

from __future__ import annotations

import random
import threading

import pytest

from rollout_engine.protocol import InvalidRequestError
from rollout_engine.worker.weights.loader import iterate_checkpoint
from tests.e2e.server_process import ENGINE_OPTIONS, wait_for
from tests.e2e.tcp_proxy import TCPProxy
from trainer_bridge import EngineClient, SamplingParams
from trainer_bridge.engine_pool import EnginePool
from trainer_bridge.server_process import EngineServer

_rng = random.Random(25)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(_rng.randint(6, 20))] for _ in range(6)]
PARAMS = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def servers(llama_dir, tmp_path_factory):
    """Two engines of the tiny Llama, started side by side."""
    log_dir = tmp_path_factory.mktemp("pool-weights")
    started: dict[str, EngineServer] = {}

    def start(name: str) -> None:
        started[name] = EngineServer(llama_dir, engine_options=ENGINE_OPTIONS,
                                     log_path=log_dir / f"{name}.log")

    threads = [threading.Thread(target=start, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert set(started) == {"a", "b"}, "a server did not start"
        yield started["a"], started["b"]
    finally:
        for server in started.values():
            server.kill()


@pytest.fixture
def pool_and_proxy(servers):
    """A pool of engine a (direct) and engine b (through a proxy), both at one pushed version."""
    a, b = servers
    with TCPProxy(b.address) as proxy, EnginePool(
        [a.address, proxy.address], timeout=60, probe_interval_s=0.0
    ) as pool:
        yield pool, proxy, a


def weights_of(model_dir):
    return list(iterate_checkpoint(str(model_dir)))


def reference(address: str) -> list[list[list[int]]]:
    with EngineClient(address, timeout=60) as client:
        return tokens(client.generate(PROMPTS, PARAMS))


def reconnect(pool: EnginePool, proxy: TCPProxy) -> None:
    """Undo the partition and wait out the channel's reconnect backoff."""
    proxy.restore()
    pool.members[1].client.wait_until_ready(30)


@pytest.mark.parametrize("when", ["unreachable during the push", "cut off during the push"])
def test_an_engine_that_missed_a_push_serves_nothing_until_one_reaches_it(
    pool_and_proxy, llama_dir, other_model_dirs, when
):
    pool, proxy, a = pool_and_proxy
    old, new = weights_of(llama_dir), weights_of(other_model_dirs[1])
    pool.update_weights(old)
    old_tokens = tokens(pool.generate(PROMPTS, PARAMS))
    assert set(pool.last_assignment.values()) == {a.address, proxy.address}

    if when == "unreachable during the push":
        proxy.cut()  # b misses a generate (taken out), then the whole push
        assert tokens(pool.generate(PROMPTS, PARAMS)) == old_tokens
        assert proxy.address not in pool.live_addresses
        pool.update_weights(new)
    else:  # b gets a part of the push's bytes, then its connection drops
        proxy.cut_after_bytes(200_000)
        pool.update_weights(new, transport="stream", bucket_bytes=64 * 1024)
        assert proxy.address not in pool.live_addresses
    new_tokens = reference(a.address)
    assert new_tokens != old_tokens  # else the test could not tell the policies apart

    reconnect(pool, proxy)  # b answers again, never restarted, still without the new push
    assert tokens(pool.generate(PROMPTS, PARAMS)) == new_tokens
    assert proxy.address in pool.live_addresses
    assert set(pool.last_assignment.values()) == {a.address}  # b rejoined but did not generate

    pool.update_weights(new)  # a push that reaches b in full: b generates again
    assert tokens(pool.generate(PROMPTS, PARAMS)) == new_tokens
    assert set(pool.last_assignment.values()) == {a.address, proxy.address}
    pool.update_weights(old)  # the next test starts from the checkpoint's weights


def test_one_engines_error_cancels_the_others_and_releases_every_load(pool_and_proxy):
    pool, proxy, a = pool_and_proxy
    long_params = SamplingParams(n=8, temperature=1.0, max_tokens=200, seed=1, ignore_eos=True)
    bad_prompt = [1, 2, 10**6]  # outside b's vocabulary
    with EngineClient(a.address, timeout=30) as client:
        tokens_before = client.info().num_generated_tokens_total
        # The least-loaded rule sends the first prompt to a and the second to b.
        with pytest.raises(InvalidRequestError, match=proxy.address):
            pool.generate([PROMPTS[0], bad_prompt], long_params)
        assert [m.num_assigned_samples for m in pool.members] == [0, 0]
        # The RPC ends when its handler returns; the engine drops the aborted request at its
        # next step, so the two counts reach 0 a moment apart.
        def drained() -> bool:
            info = client.info()
            return info.num_inflight_requests == 0 and info.num_unfinished_requests == 0

        assert wait_for(drained, timeout_s=10)
        info = client.info()
        # Cancelled early: its 8 samples ended well short of 200 tokens each.
        assert info.num_generated_tokens_total - tokens_before < 8 * 200
    # Both engines still serve, and the pool spreads the next call over both.
    assert len(pool.generate(PROMPTS, PARAMS)) == len(PROMPTS)
    assert set(pool.last_assignment.values()) == {a.address, proxy.address}
