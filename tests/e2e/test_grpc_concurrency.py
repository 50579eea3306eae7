"""200 concurrent Generate streams from several client threads all complete correctly."""

from __future__ import annotations

import random
import threading

import pytest

from rollout_engine import SamplingParams as EngineSamplingParams
from trainer_bridge import SamplingParams

NUM_STREAMS = 200
NUM_THREADS = 8
SETTINGS = {"temperature": 1.0, "max_tokens": 6, "ignore_eos": True}


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(2, 12))] for _ in range(NUM_STREAMS)]


def test_200_concurrent_streams(client, llm):
    prompts = make_prompts()
    # A per-request seed makes each sample independent of how requests are batched.
    params = [dict(SETTINGS, seed=i) for i in range(NUM_STREAMS)]
    expected = llm.generate(prompts, [EngineSamplingParams(**p) for p in params])
    results: dict[int, object] = {}
    errors: list[BaseException] = []
    all_open = threading.Barrier(NUM_THREADS)

    def worker(indices: list[int]) -> None:
        try:
            streams = {i: client.generate_stream(prompts[i], SamplingParams(**params[i]))
                       for i in indices}
            firsts = {i: next(stream) for i, stream in streams.items()}  # every call is open
            all_open.wait(timeout=60)
            for i, stream in streams.items():
                last = firsts[i]
                for last in stream:
                    pass
                results[i] = last
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            all_open.abort()

    threads = [threading.Thread(target=worker, args=(list(range(t, NUM_STREAMS, NUM_THREADS)),))
               for t in range(NUM_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors[:3]
    assert len(results) == NUM_STREAMS
    for i, want in enumerate(expected):
        got = results[i]
        assert got.finished and got.prompt_token_ids == want.prompt_token_ids
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, f"stream {i}"
        # Arrival order sets the batch composition, which moves logprobs by float rounding.
        assert got.outputs[0].logprobs == pytest.approx(want.outputs[0].logprobs, abs=1e-4)
    assert client.info().num_inflight_requests == 0
