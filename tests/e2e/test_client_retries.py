"""Idempotent calls retry on UNAVAILABLE with backoff; generate and updates do not."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from trainer_bridge import EngineClient, SamplingParams, UnavailableError


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_idempotent_calls_retry_then_raise_unavailable():
    with EngineClient(f"127.0.0.1:{unused_port()}", max_retries=3, timeout=5) as client:
        start = time.monotonic()
        with pytest.raises(UnavailableError):
            client.info()
        assert time.monotonic() - start >= 0.05 + 0.1 + 0.2  # three backoff sleeps
        for call in (client.memory_state, client.reset_prefix_cache, lambda: client.sleep(2)):
            with pytest.raises(UnavailableError):
                call()


def test_generate_and_update_fail_fast():
    with EngineClient(f"127.0.0.1:{unused_port()}", max_retries=20, timeout=5) as client:
        start = time.monotonic()
        with pytest.raises(UnavailableError):
            client.generate([[1, 2, 3]], SamplingParams(max_tokens=1))
        with pytest.raises(UnavailableError):
            client.update_weights({"w": torch.ones(4)}, transport="stream")
        assert time.monotonic() - start < 2.0, "no retries with a 20-retry budget"
