"""The step executors on their own: where each runs a forward and the host work beside it, the
order steps land in, and a failed step taking every later one with it (the unstarted ones
never run). The forward here is a plain function of the step: the executor is under test."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch

from rollout_engine.engine.step_executor import (
    FailedSteps,
    ForwardThreadExecutor,
    HostThreadExecutor,
    LandedStep,
    SyncExecutor,
    run_here,
)


class Step:
    """Stands in for a PreparedStep: the executor only hands it to the forward."""

    def __init__(self, name: str, fail: bool = False, delay_s: float = 0.0) -> None:
        self.name, self.fail, self.delay_s = name, fail, delay_s


class Forward:
    """Records which step ran on which thread."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, str]] = []

    def __call__(self, step: Step) -> str:
        time.sleep(step.delay_s)
        self.ran.append((step.name, threading.current_thread().name))
        if step.fail:
            raise RuntimeError(f"step {step.name} failed")
        return f"output of {step.name}"


def make(kind: str, forward: Forward):
    if kind == "sync":
        return SyncExecutor(forward)
    if kind == "forward-thread":
        return ForwardThreadExecutor(forward, torch.device("cpu"))
    return HostThreadExecutor(forward)


KINDS = ["sync", "forward-thread", "host-thread"]
CALLER = threading.current_thread().name


def launch(executor, name: str, host_work_log: list | None = None, **step_options) -> None:
    def host_work(step: Step) -> None:
        if host_work_log is not None:
            host_work_log.append(step.name)

    executor.launch(name, run_here(lambda: Step(name, **step_options)), host_work)


@pytest.mark.parametrize("kind", KINDS)
def test_steps_land_in_launch_order_with_their_outputs(kind):
    forward = Forward()
    executor = make(kind, forward)
    host_work: list[str] = []
    launch(executor, "a", host_work, delay_s=0.05)
    if executor.max_in_flight == 2:
        executor.overlap(lambda: launch(executor, "b", host_work))
        assert executor.num_in_flight == 2 and executor.is_full
    landed = [executor.land() for _ in range(executor.num_in_flight)]
    assert all(isinstance(x, LandedStep) for x in landed)
    names = [x.scheduler_output for x in landed]
    assert names == (["a", "b"] if executor.max_in_flight == 2 else ["a"])
    assert [x.runner_output for x in landed] == [f"output of {n}" for n in names]
    assert host_work == names  # each step's host work ran once, before it landed
    threads = {thread for _, thread in forward.ran}
    if kind == "forward-thread":
        assert {t.split("_")[0] for t in threads} == {"engine-forward"}
    else:
        assert threads == {CALLER}  # the CPU keeps the forward on the caller's thread
    executor.shutdown()


def test_host_thread_runs_the_next_steps_host_work_beside_the_forward():
    forward = Forward()
    executor = HostThreadExecutor(forward)
    launch(executor, "a", delay_s=0.05)
    assert forward.ran == []  # deferred: it runs beside the next step's host work
    seen = {}

    def host_work() -> bool:
        seen["thread"] = threading.current_thread().name
        seen["num_threads"] = torch.get_num_threads()
        seen["forward_done"] = bool(forward.ran)
        return True

    assert executor.overlap(host_work) is True
    assert seen["thread"].startswith("engine-host") and seen["num_threads"] == 1
    assert not seen["forward_done"], "the host work should run while the forward runs"
    assert forward.ran == [("a", CALLER)]
    assert isinstance(executor.land(), LandedStep)
    executor.shutdown()


@pytest.mark.parametrize("kind", ["forward-thread", "host-thread"])
def test_a_failed_step_takes_the_later_one_with_it(kind):
    forward = Forward()
    executor = make(kind, forward)
    launch(executor, "a", fail=True)
    executor.overlap(lambda: launch(executor, "b"))
    landed = executor.land()
    assert isinstance(landed, FailedSteps)
    assert landed.scheduler_outputs == ["a", "b"] and "step a failed" in str(landed.error)
    assert executor.num_in_flight == 0
    if kind == "host-thread":  # b had not started: it never runs
        assert [name for name, _ in forward.ran] == ["a"]
    executor.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_whose_inputs_failed_lands_as_its_failure(kind):
    forward = Forward()
    executor = make(kind, forward)
    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_exception(ValueError("bad inputs"))
    executor.launch("a", failed, lambda step: pytest.fail("no host work for failed inputs"))
    assert executor.oldest_is_done()
    landed = executor.land()
    assert isinstance(landed, FailedSteps) and isinstance(landed.error, ValueError)
    assert forward.ran == []
    executor.shutdown()
