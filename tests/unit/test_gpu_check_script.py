"""scripts/gpu_check.sh, checked where no GPU is: its syntax and groups (fast), and a dry run
that collects every group's GPU tests and parses every benchmark's options (slow)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "gpu_check.sh"


def test_script_parses_and_its_groups_name_existing_files():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    groups = re.findall(r'^  "([^"|]+)\|([^"]+)"$', SCRIPT.read_text(), re.MULTILINE)
    assert len(groups) >= 5
    for _, files in groups:
        for file in files.split():
            assert (REPO_ROOT / file).is_file(), file


@pytest.mark.slow
def test_dry_run_collects_every_group_and_parses_every_benchmark(tmp_path):
    env = {**os.environ, "GPU_CHECK_COLLECT_ONLY": "1", "PYTHON": sys.executable,
           "GPU_CHECK_LOG_DIR": str(tmp_path)}
    result = subprocess.run(["bash", str(SCRIPT)], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "FAIL" not in summary and summary.count("PASS") >= 9, summary
