"""Per-request timings and token counts, measured where tokens land (the output processor, for
every output kind) and kept as counters and fixed-bucket histograms: what the server exposes as
vLLM's `vllm:*` metrics. Torch-free; written on the engine thread, read there by `snapshot()`.

Each sampled request (each of a prompt's `n`) counts on its own, as in vLLM, whose `n` fans out
into separate requests: time to first token from the prompt's arrival, one inter-token latency
per step that brought it tokens after the first, and at its end the end-to-end latency, its
prompt and generated token counts and its finish reason. Memory is one small record per
unfinished request plus the histograms' buckets, whether or not anyone reads them.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout_engine.core.request import Request
    from rollout_engine.core.scheduler_output import NewRequestData

# vLLM's bucket boundaries (vllm/v1/metrics/buckets.py).
TIME_TO_FIRST_TOKEN_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error", "repetition")
"""vLLM's finish reasons, each a `finished_reason` label from the start (this engine ends
requests with the first three)."""


def token_count_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to `max_model_len`: 1, 2, 5, 10, 20, 50, ..."""
    bounds: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(bounds)
            bounds.append(float(mantissa * scale))
        scale *= 10


@dataclass
class Histogram:
    """Counts per bucket (`counts[i]`: observations in (bounds[i-1], bounds[i]], the last one
    past every bound) and their sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.sum)


@dataclass
class RequestStatsSnapshot:
    """Everything recorded so far (cumulative since start), copied for another thread."""

    num_prefix_cache_queries: int
    num_prompt_tokens: int
    """Prompt tokens of the requests that produced their first token (vLLM's
    `prompt_tokens`)."""
    num_generation_tokens: int
    num_finished: dict[str, int]
    """Finished requests by finish reason."""
    time_to_first_token_s: Histogram
    inter_token_latency_s: Histogram
    e2e_request_latency_s: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram


@dataclass
class _Timing:
    arrival_s: float
    num_prompt_tokens: int
    last_token_s: float | None = None
    num_output_tokens: int = 0


class RequestStats:
    """The recorder: `on_added` when requests arrive, `on_scheduled` with a step's new
    requests, `on_tokens` with the requests a step updated, `on_finished` when their prompt's
    final output is made."""

    def __init__(self, max_model_len: int = 1, prefix_caching: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._prefix_caching = prefix_caching
        self._timings: dict[str, _Timing] = {}
        self.num_prefix_cache_queries = 0
        """Tokens looked up in the prefix cache (vLLM's `prefix_cache_queries`)."""
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished = dict.fromkeys(FINISH_REASONS, 0)
        self.time_to_first_token_s = Histogram(TIME_TO_FIRST_TOKEN_BUCKETS_S)
        self.inter_token_latency_s = Histogram(INTER_TOKEN_LATENCY_BUCKETS_S)
        self.e2e_request_latency_s = Histogram(REQUEST_LATENCY_BUCKETS_S)
        self.request_prompt_tokens = Histogram(token_count_buckets(max_model_len))
        self.request_generation_tokens = Histogram(token_count_buckets(max_model_len))

    def on_added(self, requests: Iterable[Request]) -> None:
        now = self._clock()
        for request in requests:
            self._timings[request.request_id] = _Timing(now, request.num_prompt_tokens)

    def on_scheduled(self, new_requests: Iterable[NewRequestData]) -> None:
        """Requests scheduled for the first time or again after a preemption: the scheduler
        looked their tokens up in the prefix cache."""
        if self._prefix_caching:
            self.num_prefix_cache_queries += sum(
                len(r.prompt_token_ids) + len(r.output_token_ids) for r in new_requests)

    def on_tokens(self, requests: Iterable[Request]) -> None:
        """A step landed: its requests' new tokens, and the end of those it finished."""
        now = self._clock()
        for request in requests:
            timing = self._timings.get(request.request_id)
            if timing is None:
                continue
            num_new = request.num_output_tokens - timing.num_output_tokens
            if num_new > 0:
                self._record_tokens(timing, num_new, now)
            if request.is_finished:
                self._finish(request, timing, now)

    def on_finished(self, requests: Iterable[Request]) -> None:
        """Their prompt has its final output: the requests not recorded as finished yet
        (aborted ones) end now."""
        now = self._clock()
        for request in requests:
            timing = self._timings.get(request.request_id)
            if timing is not None:
                self._finish(request, timing, now)

    def _record_tokens(self, timing: _Timing, num_new: int, now: float) -> None:
        if timing.last_token_s is None:
            self.time_to_first_token_s.observe(now - timing.arrival_s)
            self.num_prompt_tokens += timing.num_prompt_tokens
        else:
            self.inter_token_latency_s.observe(now - timing.last_token_s)
        timing.last_token_s = now
        timing.num_output_tokens += num_new
        self.num_generation_tokens += num_new

    def _finish(self, request: Request, timing: _Timing, now: float) -> None:
        del self._timings[request.request_id]
        reason = request.finish_reason or "abort"
        self.num_finished[reason] = self.num_finished.get(reason, 0) + 1
        self.e2e_request_latency_s.observe(now - timing.arrival_s)
        self.request_prompt_tokens.observe(timing.num_prompt_tokens)
        self.request_generation_tokens.observe(timing.num_output_tokens)

    def counters(self) -> dict[str, int]:
        """The counters, as `EngineInfo.engine_stats` carries them over the wire."""
        return {
            "num_prefix_cache_queries": self.num_prefix_cache_queries,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            **{f"num_finished_{reason}": n for reason, n in self.num_finished.items()},
        }

    def snapshot(self) -> RequestStatsSnapshot:
        return RequestStatsSnapshot(
            self.num_prefix_cache_queries, self.num_prompt_tokens, self.num_generation_tokens,
            dict(self.num_finished),
            self.time_to_first_token_s.copy(), self.inter_token_latency_s.copy(),
            self.e2e_request_latency_s.copy(), self.request_prompt_tokens.copy(),
            self.request_generation_tokens.copy())
