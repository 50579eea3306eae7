"""The CPU thread policy: the forward gives up the cores other processes keep busy."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from rollout_engine.worker.cpu_threads import CpuSample, CpuThreadPolicy, read_cpu_sample


class Samples:
    """Readings fed to the policy: (machine busy cores, our busy cores) per interval."""

    def __init__(self) -> None:
        self.sample = CpuSample(0.0, 0.0, 0.0)

    def advance(self, seconds: float, machine_cores: float, own_cores: float) -> None:
        s = self.sample
        self.sample = CpuSample(s.machine_busy_s + machine_cores * seconds,
                                s.process_s + own_cores * seconds, s.wall_s + seconds)

    def __call__(self) -> CpuSample:
        return self.sample


@pytest.mark.parametrize(
    ("machine_cores", "own_cores", "threads"),
    [
        (2.0, 2.0, 4),   # only us: every core
        (2.3, 2.0, 4),   # background noise under half a core
        (3.0, 2.0, 3),   # one busy neighbour: give it a core
        (3.8, 1.9, 2),   # two
        (8.0, 1.0, 1),   # a full machine: still one thread
    ],
)
def test_threads_follow_the_load_of_other_processes(machine_cores, own_cores, threads):
    samples = Samples()
    policy = CpuThreadPolicy(max_threads=4, read=samples, check_interval_s=0.5)
    assert policy.threads() == 4
    samples.advance(1.0, machine_cores, own_cores)
    assert policy.threads() == threads
    assert policy.others_busy_cores == pytest.approx(machine_cores - own_cores)
    samples.advance(1.0, own_cores, own_cores)  # the neighbour went away
    assert policy.threads() == 4


def test_no_decision_before_the_interval_and_a_fixed_count_is_kept():
    samples = Samples()
    policy = CpuThreadPolicy(max_threads=4, read=samples, check_interval_s=0.5)
    samples.advance(0.2, 4.0, 0.0)
    assert policy.threads() == 4, "0.2 s is too short to judge"
    assert CpuThreadPolicy(fixed=3, read=samples).threads() == 3


@pytest.mark.skipif(read_cpu_sample() is None, reason="needs /proc")
def test_a_real_busy_process_is_seen():
    policy = CpuThreadPolicy(max_threads=2, check_interval_s=0.3)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # let it start
        policy.threads()
        time.sleep(0.5)
        assert policy.threads() == 1
        assert policy.others_busy_cores >= 0.5
    finally:
        busy.kill()
        busy.wait()

