"""The server's engine thread: a crash of the loop itself fails every call instead of leaving it
waiting forever, and responsiveness (what health reports) follows the thread's state."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from rollout_engine.protocol import InternalError
from rollout_engine.server.engine_loop import EngineLoop


class IdleEngine:
    """Stands in for LLMEngine where the loop only asks whether there is work: a loop bug is
    injected by making that question raise."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.broken = threading.Event()

    def has_unfinished_requests(self) -> bool:
        if self.broken.is_set():
            raise RuntimeError("a bug in the loop")
        return False

    def can_make_progress(self) -> bool:
        return self.has_unfinished_requests()


def test_a_crashed_engine_thread_fails_calls_and_reports_unresponsive():
    async def scenario() -> None:
        engine = IdleEngine()
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        assert await loop.call(lambda: 41 + 1) == 42
        assert loop.is_responsive(stall_s=5.0)
        engine.broken.set()
        with pytest.raises(InternalError, match="crashed"):
            for _ in range(3):  # a call racing the crash may still run; a later one cannot
                await asyncio.wait_for(loop.call(lambda: 2), timeout=5)  # never waits forever
        assert not loop.is_responsive(stall_s=5.0)
        loop.stop(timeout_s=5)

    asyncio.run(scenario())


def test_a_long_command_makes_the_loop_unresponsive_until_it_returns():
    async def scenario() -> None:
        loop = EngineLoop(IdleEngine(), asyncio.get_running_loop())
        loop.start()
        slow = loop.call(time.sleep, 0.6)
        task = asyncio.ensure_future(slow)
        await asyncio.sleep(0.4)
        assert not loop.is_responsive(stall_s=0.2)
        await task
        assert loop.is_responsive(stall_s=0.2)
        loop.stop(timeout_s=5)

    asyncio.run(scenario())
