"""vLLM's `vllm:*` Prometheus metrics, served by `/metrics` beside this server's own
`rollout_engine_*` families, so that vLLM's dashboards and alerts read this server unchanged.

One registry per server. The engine keeps the counts (`EngineInfo.engine_stats`) and the
histograms (`AsyncEngine.metrics()`, measured where tokens land); a scrape reads both from
the engine thread and renders them here with prometheus_client's exposition. Every family
carries vLLM's labels, `model_name` (the served name) and `engine="0"`, and vLLM's help text
and bucket boundaries.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from rollout_engine.engine.request_stats import Histogram, RequestStatsSnapshot
    from rollout_engine.protocol import EngineInfo

LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"
"""vLLM numbers the engines of a data-parallel server; this server has one."""
# (vLLM's name, its help text, the engine_stats key holding the count)
_COUNTERS = (
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
     "num_preemptions"),
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "num_prompt_tokens"),
    ("vllm:generation_tokens", "Number of generation tokens processed.",
     "num_generation_tokens"),
    ("vllm:prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens.", "num_prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     "num_prefix_hit_tokens"),
    # Speculative decoding: a draft is one request's proposal for one step.
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_num_draft_steps"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_num_drafts"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
     "spec_num_accepted_tokens"),
)
# (vLLM's name, its help text, the snapshot's attribute)
_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
     "time_to_first_token_s"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
     "inter_token_latency_s"),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
     "e2e_request_latency_s"),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
     "request_prompt_tokens"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.",
     "request_generation_tokens"),
)


class VllmMetrics:
    """The `vllm:*` families of one server: `render(info, stats)` is their exposition text."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._label_values = [model_name, ENGINE_INDEX]
        self._latest: tuple[EngineInfo, RequestStatsSnapshot] | None = None
        self.registry.register(self)

    def render(self, info: EngineInfo, stats: RequestStatsSnapshot) -> str:
        self._latest = (info, stats)
        return generate_latest(self.registry).decode()

    def collect(self) -> Iterator[Metric]:
        if self._latest is None:
            return
        info, stats = self._latest
        yield from self._gauges(info)
        yield from self._counters(info, stats)
        for name, help_text, attribute in _HISTOGRAMS:
            yield self._histogram(name, help_text, getattr(stats, attribute))

    def _gauges(self, info: EngineInfo) -> Iterator[Metric]:
        engine_stats = info.engine_stats
        num_used = info.num_blocks - info.num_free_blocks
        for name, help_text, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             engine_stats.get("num_running_requests", 0)),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             engine_stats.get("num_waiting_requests", 0)),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             num_used / info.num_blocks if info.num_blocks else 0.0),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=LABELS)
            gauge.add_metric(self._label_values, value)
            yield gauge

    def _counters(self, info: EngineInfo, stats: RequestStatsSnapshot) -> Iterator[Metric]:
        engine_stats = info.engine_stats
        for name, help_text, key in _COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=LABELS)
            counter.add_metric(self._label_values, engine_stats.get(key, 0))
            yield counter
        success = CounterMetricFamily("vllm:request_success",
                                      "Count of successfully processed requests.",
                                      labels=[*LABELS, "finished_reason"])
        for reason, count in stats.num_finished.items():
            success.add_metric([*self._label_values, reason], count)
        yield success

    def _histogram(self, name: str, help_text: str, histogram: Histogram) -> Metric:
        family = HistogramMetricFamily(name, help_text, labels=LABELS)
        buckets, cumulative = [], 0
        for bound, count in zip((*histogram.bounds, float("inf")), histogram.counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric(self._label_values, buckets, histogram.sum)
        return family
