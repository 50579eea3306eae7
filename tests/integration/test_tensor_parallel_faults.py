"""Tensor-parallel ranks that die or hang fail the step naming the rank, within the group's
timeout; the ranks' processes end with the engine (shutdown, collection, interpreter exit)."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_engine import LLM, SamplingParams
from rollout_engine.protocol import RankFailedError

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
OPTIONS = {"kv_cache_bytes": 1 << 20, "block_size": 4, "cpu_threads": 1}


def start(model_dir, **options) -> LLM:
    return LLM(str(model_dir), tensor_parallel_size=2, **OPTIONS, **options)


def rank_process(llm: LLM):
    (process,) = llm.engine.worker.ranks.processes
    return process


def wait_until_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_killed_rank_fails_the_step_naming_it_and_the_engine_refuses_more(llama_dir):
    llm = start(llama_dir, distributed_timeout_s=120)  # loading on a busy machine
    llm.generate(PROMPTS, GREEDY)
    process = rank_process(llm)
    os.kill(process.pid, signal.SIGKILL)
    process.join(5)
    started = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1"):
        llm.generate(PROMPTS, GREEDY)
    assert time.monotonic() - started < 10  # found dead at once, not after the timeout
    with pytest.raises(RankFailedError, match="restart the engine"):
        llm.generate(PROMPTS, GREEDY)
    llm.shutdown()


@pytest.mark.slow  # waits out the group timeout
def test_hung_rank_fails_the_step_after_the_group_timeout(llama_dir):
    llm = start(llama_dir, distributed_timeout_s=3)
    llm.generate(PROMPTS, GREEDY)
    process = rank_process(llm)
    os.kill(process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank\(s\) 1 had not finished it"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - started < 15
    finally:
        os.kill(process.pid, signal.SIGCONT)
    llm.shutdown()
    assert not process.is_alive()


@pytest.mark.slow  # starts and stops three TP engines
def test_shutdown_and_collection_stop_the_ranks(llama_dir):
    llm = start(llama_dir)
    process = rank_process(llm)
    llm.shutdown()
    assert not process.is_alive() and process.exitcode == 0
    llm = start(llama_dir)
    pid = rank_process(llm).pid
    del llm
    gc.collect()
    assert wait_until_gone(pid)


@pytest.mark.slow  # a fresh interpreter that starts a TP engine
def test_interpreter_exit_stops_the_ranks(llama_dir):
    script = (
        "from rollout_engine import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(llama_dir)!r}, tensor_parallel_size=2, kv_cache_bytes=1 << 20)\n"
        "    print(llm.engine.worker.ranks.processes[0].pid, flush=True)\n"
    )
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert wait_until_gone(int(result.stdout.split()[-1]))
