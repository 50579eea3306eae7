"""`examples/ppo_colocate.py` at its defaults: the reward rises, the plots are written."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_example_reward_rises_and_plots_are_written(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "ppo_colocate.py"), "--out", str(tmp_path)],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True,
        text=True, check=False, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rewards = json.loads((tmp_path / "rewards.json").read_text())["reward"]
    assert len(rewards) == 30
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    assert last > first + 0.3, rewards
    for name in ("reward_curve.png", "memory_timeline.png"):
        assert (tmp_path / name).stat().st_size > 10_000
        assert f"wrote {tmp_path / name}" in result.stdout
    timeline = json.loads((tmp_path / "memory_timeline.json").read_text())
    assert set(timeline["rss_bytes"]) == {"trainer", "engine"}
    assert timeline["summary"]["samples_per_s"] >= 20
    names = {p["name"] for p in timeline["phases"]}
    assert {"generate", "sleep", "train", "wake_weights", "weight_sync", "wake_kv_cache"} <= names
