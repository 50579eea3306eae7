"""The server's engine thread: a crash of the loop itself fails every call instead of leaving it
waiting forever, responsiveness (what health reports) follows the thread's state, and the one
pause state (running, draining to pause, paused) answers every pause, resume and is_paused."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rollout_engine.protocol import EngineSleepingError, InternalError, SamplingParams
from rollout_engine.server.engine_loop import EngineLoop, OutputSink, PauseResult


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


class StepGatedEngine:
    """Stands in for LLMEngine around pause and sleep: a prompt finishes after `max_tokens`
    steps, and a step runs only when the test lets it (`steps.release(n)`)."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.remaining: dict[str, int] = {}
        self.steps = threading.Semaphore(0)
        self.paused = False
        self.slept = False

    def add_request(self, request_id, prompt, sampling_params, output_kind, **options) -> None:
        self.remaining[request_id] = sampling_params.max_tokens

    def abort_request(self, request_ids) -> None:
        for request_id in request_ids:
            self.remaining.pop(request_id, None)

    @property
    def unfinished_request_ids(self) -> list[str]:
        return list(self.remaining)

    def can_make_progress(self) -> bool:
        return bool(self.remaining) and not self.paused

    def step(self) -> list[SimpleNamespace]:
        if not self.steps.acquire(timeout=0.01):
            return []
        for request_id in self.remaining:
            self.remaining[request_id] -= 1
        done = [rid for rid, num_left in self.remaining.items() if num_left == 0]
        self.abort_request(done)
        return [SimpleNamespace(request_id=rid, finished=True) for rid in done]

    def pause_generation(self, mode: str, clear_cache: bool = True) -> list:
        assert mode == "abort" and not self.remaining  # the loop pauses once drained
        self.paused = True
        return []

    def resume_generation(self) -> None:
        self.paused = False

    def is_paused(self) -> bool:
        return self.paused

    def sleep(self, level, mode: str = "abort") -> list:
        assert mode == "abort" and not self.remaining
        self.slept = True
        return []


def prompt(request_id: str, num_steps: int) -> list[tuple[str, list[int], SamplingParams]]:
    return [(request_id, [1, 2], SamplingParams(max_tokens=num_steps))]


async def started_loop(engine: StepGatedEngine) -> EngineLoop:
    loop = EngineLoop(engine, asyncio.get_running_loop())
    loop.start()
    return loop


def test_a_resume_during_a_wait_pause_cancels_the_pause():
    """The bug: the resume answered, then the drain's end paused the engine, and a request
    sent after it waited forever. Now the pause reads as paused from its start (vLLM's pause
    state is set at once), the resume starts what was held, and the drain's caller hears once
    its prompts are done that it did not pause (vLLM's pause returns then too, unpaused)."""
    async def scenario() -> None:
        engine = StepGatedEngine()
        loop = await started_loop(engine)
        first, late = OutputSink(), OutputSink()
        await loop.add_requests(prompt("first", 3), first)
        pause = asyncio.ensure_future(loop.pause("wait"))
        while not await loop.is_paused():  # draining: already paused to the clients
            await asyncio.sleep(0.005)
        held = asyncio.ensure_future(loop.add_requests(prompt("late", 2), late))
        await asyncio.sleep(0.05)
        assert not held.done() and not pause.done()
        await loop.resume()
        await asyncio.wait_for(held, 5)  # added at the resume
        assert not await loop.is_paused()
        engine.steps.release(3)
        assert await asyncio.wait_for(pause, 5) == PauseResult(1, is_paused=False)
        assert (await first.get()).finished and (await late.get()).finished
        assert not engine.paused and not await loop.is_paused()
        after = OutputSink()
        await loop.add_requests(prompt("after", 1), after)
        engine.steps.release(1)
        assert (await asyncio.wait_for(after.get(), 5)).finished  # served, not held
        loop.stop(timeout_s=5)

    asyncio.run(scenario())


def test_a_wait_pause_without_a_resume_pauses_once_drained():
    async def scenario() -> None:
        engine = StepGatedEngine()
        loop = await started_loop(engine)
        await loop.add_requests(prompt("first", 2), OutputSink())
        pause = asyncio.ensure_future(loop.pause("wait"))
        held = asyncio.ensure_future(loop.add_requests(prompt("late", 1), OutputSink()))
        while not await loop.is_paused():  # the drain has begun
            await asyncio.sleep(0.005)
        engine.steps.release(2)
        assert await asyncio.wait_for(pause, 5) == PauseResult(1, is_paused=True)
        await asyncio.wait_for(held, 5)  # added once paused: it queues for the resume
        assert engine.paused and await loop.is_paused() and engine.remaining == {"late": 1}
        await loop.resume()
        assert not await loop.is_paused()
        loop.stop(timeout_s=5)

    asyncio.run(scenario())


def test_a_resume_leaves_a_wait_sleep_to_sleep():
    """A resume answers pauses only: a Sleep with mode "wait" still sleeps once drained, and
    refuses new prompts meanwhile."""
    async def scenario() -> None:
        engine = StepGatedEngine()
        loop = await started_loop(engine)
        await loop.add_requests(prompt("first", 2), OutputSink())
        sleep = asyncio.ensure_future(loop.sleep(1, "wait"))
        await asyncio.sleep(0.05)
        await loop.resume()
        with pytest.raises(EngineSleepingError, match="draining"):
            await loop.add_requests(prompt("late", 1), OutputSink())
        assert not await loop.is_paused()
        engine.steps.release(2)
        assert await asyncio.wait_for(sleep, 5) == 1 and engine.slept
        loop.stop(timeout_s=5)

    asyncio.run(scenario())
