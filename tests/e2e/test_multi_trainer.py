"""Two trainer processes (`accelerate launch`, gloo on CPU), each paired with its own engine
server: the one-engine-per-device layout, run for two GRPO steps."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
RANK_LINE = re.compile(r"rank (\d): engine (\S+) \(pid (\d+)\), weight_version (\d+), "
                       r"policy fingerprint (\S+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(shutil.which("accelerate", path=os.path.dirname(sys.executable)) is None,
                    reason="needs accelerate")
@pytest.mark.slow  # two accelerate-launched trainers and two servers: 20-30 s
def test_two_trainer_engine_pairs(tmp_path):
    # accelerate's --cpu launcher needs MPI for several processes; --multi_gpu starts them with
    # torchrun, and the script's use_cpu turns that into gloo on CPU.
    command = [
        os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--multi_gpu",
        "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(REPO_ROOT / "examples" / "ppo_colocate.py"), "--steps", "2", "--batch", "8",
        "--num-generations", "4", "--max-completion-length", "8", "--out", str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            check=False, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = {int(m[0]): m[1:] for m in RANK_LINE.findall(result.stdout)}
    assert sorted(ranks) == [0, 1], result.stdout[-3000:]
    (address0, pid0, version0, fingerprint0), (address1, pid1, version1, fingerprint1) = (
        ranks[0], ranks[1])
    assert address0 != address1 and pid0 != pid1  # one engine per trainer process
    assert version0 == version1 == "3"  # pushed before each of 2 rollouts, and once at the end
    assert fingerprint0 == fingerprint1  # DDP kept the two policies identical
    for name in ("reward_curve-rank0.png", "memory_timeline-rank1.json", "engine-rank1.log"):
        assert (tmp_path / name).stat().st_size > 0
