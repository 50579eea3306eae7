"""Measured memory of the CPU backend: each scenario runs in a fresh interpreter."""

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.memory_growth import leak_bytes, max_leak_bytes

REPO_ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).with_name("memory_scenarios.py")
Scenarios = dict[str, "subprocess.Popen[str]"]


def start_scenario(name: str, device: str = "cpu") -> subprocess.Popen[str]:
    """Start one scenario of memory_scenarios.py in a fresh interpreter."""
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, str(SCENARIOS), name, device],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": python_path},
    )


def scenario_result(process: subprocess.Popen[str]) -> dict[str, Any]:
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def scenarios() -> Iterator[Scenarios]:
    """All scenarios started at once: each measures only its own process."""
    processes = {name: start_scenario(name) for name in ("discard", "offload", "cycles")}
    yield processes
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_discard_releases_resident_memory_and_wake_brings_it_back(scenarios: Scenarios) -> None:
    result = scenario_result(scenarios["discard"])
    num_bytes = result["num_bytes"]
    assert result["used_touched"] - result["used_released"] >= 0.95 * num_bytes, result
    # Waking maps lazily on CPU: nothing is resident until touched.
    assert result["used_woken"] - result["used_released"] < 0.05 * num_bytes, result
    assert result["used_retouched"] - result["used_released"] >= 0.95 * num_bytes, result
    assert result["is_zero_after_wake"] and result["retouched_ok"], result
    assert result["same_ptr"] and result["state"] == "awake", result


def test_offload_restores_exact_bytes_and_frees_the_backup(scenarios: Scenarios) -> None:
    result = scenario_result(scenarios["offload"])
    num_bytes = result["num_bytes"]
    assert result["is_exact"] and result["same_ptr"], result
    assert result["backup_bytes"] == num_bytes, result
    # While offloaded the backup holds what the pool gave up: resident memory stays put.
    assert abs(result["used_offloaded"] - result["used_touched"]) < 0.05 * num_bytes, result
    assert abs(result["used_woken"] - result["used_touched"]) < 0.05 * num_bytes, result
    # After wake + discard nothing is left of either the pool or the backup.
    assert result["used_discarded"] - result["used_base"] < 0.05 * num_bytes, result
    assert result["state"] == "discarded", result


def test_500_sleep_wake_cycles_do_not_grow_resident_memory(scenarios: Scenarios) -> None:
    """Judged on the slope, not on one point: a leak grows in both halves of the run; a heap
    arena taken once, or library pages faulted back in, move total RSS by MBs once."""
    result = scenario_result(scenarios["cycles"])
    assert result["num_ok"] == result["num_cycles"] == 500, result
    assert result["same_ptr"], result
    assert leak_bytes(result["private_rss_bytes"]) < max_leak_bytes(500), result
