"""Per-request stats as the output processor records them: time to first token, one inter-token
latency per step after the first, and at the end latency, token counts and finish reason, in
vLLM's buckets; an aborted request ends when its prompt's final output is made."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from rollout_engine.engine.request_stats import (
    INTER_TOKEN_LATENCY_BUCKETS_S,
    REQUEST_LATENCY_BUCKETS_S,
    TIME_TO_FIRST_TOKEN_BUCKETS_S,
    Histogram,
    RequestStats,
    token_count_buckets,
)


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int = 0
    finish_reason: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_vllms_buckets():
    assert token_count_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200)  # vLLM's, max_model_len 256
    assert token_count_buckets(1000)[-1] == 1000
    assert TIME_TO_FIRST_TOKEN_BUCKETS_S[:3] == (0.001, 0.005, 0.01) and len(
        TIME_TO_FIRST_TOKEN_BUCKETS_S) == 22
    assert len(INTER_TOKEN_LATENCY_BUCKETS_S) == 19 and REQUEST_LATENCY_BUCKETS_S[-1] == 7680.0
    histogram = Histogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 9.0):  # Prometheus buckets are `le`: 1.0 falls in the first
        histogram.observe(value)
    assert histogram.counts == [2, 1, 1] and histogram.sum == 12.0 and histogram.count == 4


def test_a_request_records_ttft_itl_and_its_end():
    clock = Clock()
    stats = RequestStats(max_model_len=256, clock=clock)
    a, b = FakeRequest("p/0", 7), FakeRequest("p/1", 7)
    stats.on_added([a, b])
    clock.now_s += 0.03
    a.num_output_tokens = b.num_output_tokens = 1
    stats.on_tokens([a, b])  # both samples' first token: two TTFTs, prompt counted per sample
    clock.now_s += 0.2
    a.num_output_tokens = 3  # two tokens in one step (accepted drafts): one latency
    stats.on_tokens([a])
    clock.now_s += 0.06
    a.num_output_tokens, a.finish_reason = 4, "length"
    stats.on_tokens([a])
    snapshot = stats.snapshot()
    assert snapshot.time_to_first_token_s.count == 2
    assert abs(snapshot.time_to_first_token_s.sum - 0.06) < 1e-9
    assert snapshot.inter_token_latency_s.count == 2
    assert (snapshot.num_prompt_tokens, snapshot.num_generation_tokens) == (14, 5)
    assert snapshot.num_finished["length"] == 1 and snapshot.e2e_request_latency_s.count == 1
    assert abs(snapshot.e2e_request_latency_s.sum - 0.29) < 1e-9
    assert snapshot.request_generation_tokens.sum == 4
    clock.now_s += 1.0
    b.finish_reason = "abort"  # aborted: not in a step's updates, ended with its prompt
    stats.on_finished([a, b])
    snapshot = stats.snapshot()
    assert snapshot.num_finished == {"stop": 0, "length": 1, "abort": 1, "error": 0,
                                     "repetition": 0}
    assert snapshot.request_prompt_tokens.count == 2 and snapshot.request_prompt_tokens.sum == 14
    assert stats.counters()["num_finished_abort"] == 1
    assert not stats._timings  # nothing kept for finished requests


def test_prefix_cache_queries_count_the_tokens_looked_up():
    @dataclass
    class New:
        prompt_token_ids: list[int]
        output_token_ids: list[int]

    stats = RequestStats()
    stats.on_scheduled([New([1, 2, 3], []), New([1, 2], [7, 8])])  # new, resumed
    assert stats.num_prefix_cache_queries == 7
    off = RequestStats(prefix_caching=False)
    off.on_scheduled([New([1, 2, 3], [])])
    assert off.num_prefix_cache_queries == 0


def test_the_stats_module_imports_no_torch():
    code = "import sys, rollout_engine.engine.request_stats, rollout_engine.engine.prompt_text; " \
           "print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=120)
    assert result.stdout.strip() == "False"
