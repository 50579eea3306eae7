"""Admission: how much work the server holds at once, and refusing what is past the limit."""

from __future__ import annotations

from rollout_engine.protocol import AdmissionError


class Admission:
    """Counts prompts in flight across all calls; refuses those past `max_inflight_requests`."""

    def __init__(self, max_inflight_requests: int) -> None:
        self.max_inflight_requests = max_inflight_requests
        self.num_inflight_requests = 0

    def admit(self, num_requests: int) -> _Admitted:
        """`async with admission.admit(n):` holds `n` units for the call's lifetime."""
        return _Admitted(self, num_requests)


class _Admitted:
    def __init__(self, admission: Admission, num_requests: int) -> None:
        self._admission, self._num_requests = admission, num_requests

    async def __aenter__(self) -> None:
        admission, limit = self._admission, self._admission.max_inflight_requests
        if admission.num_inflight_requests + self._num_requests > limit:
            raise AdmissionError(
                f"the server is at its limit of {limit} in-flight requests "
                f"({admission.num_inflight_requests} running, {self._num_requests} asked); "
                "retry later or start the server with a larger --max-inflight-requests"
            )
        admission.num_inflight_requests += self._num_requests

    async def __aexit__(self, *exc_info: object) -> None:
        self._admission.num_inflight_requests -= self._num_requests
