"""Admission: how much work the server holds at once, and refusing what is past the limit.

Work is counted in samples (prompts x n), each of which the engine runs as one sequence
with its own KV blocks, and checked before the engine builds anything: a small message with
a huge `n` is refused at once, never expanded on the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout_engine.protocol import AdmissionError, InvalidRequestError, SamplingParams


class Admission:
    """Counts samples in flight across all calls; refuses those past `max_inflight_requests`."""

    def __init__(self, max_inflight_requests: int, max_n: int) -> None:
        self.max_inflight_requests = max_inflight_requests
        self.max_n = max_n
        self.num_inflight_requests = 0

    def acquire(self, params: Sequence[SamplingParams]) -> int:
        """Hold one unit per sample of these prompts (one SamplingParams per prompt); the units
        held, to give back with `release` when the call ends."""
        for p in params:
            if p.n > self.max_n:
                raise InvalidRequestError(
                    f"n={p.n} samples per prompt exceeds this server's limit of {self.max_n}; "
                    "ask for fewer, or start the server with a larger --max-n"
                )
        num_requests, limit = sum(p.n for p in params), self.max_inflight_requests
        if self.num_inflight_requests + num_requests > limit:
            raise AdmissionError(
                f"the server is at its limit of {limit} in-flight requests (samples) "
                f"({self.num_inflight_requests} running, {num_requests} asked); "
                "retry later or start the server with a larger --max-inflight-requests"
            )
        self.num_inflight_requests += num_requests
        return num_requests

    def release(self, num_requests: int) -> None:
        self.num_inflight_requests -= num_requests
