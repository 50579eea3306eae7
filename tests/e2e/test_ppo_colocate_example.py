"""`examples/ppo_colocate.py` (its defaults, 40 of its 100 steps): the reward rises past
what a prompt-blind policy can earn, the engine's logprobs are the trainer's bit for bit
(batch-invariant on both sides), the plots are written."""

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
        [sys.executable, str(REPO_ROOT / "examples" / "ppo_colocate.py"), "--out", str(tmp_path),
         "--steps", "40"],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True,
        text=True, check=False, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads((tmp_path / "rewards.json").read_text())
    rewards = metrics["reward"]
    assert len(rewards) == 40
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    # Above 0.5 only a policy that reads its prompt's instruction can go.
    assert first < 0.3 and last > 0.8, rewards
    # Batch-invariant on both sides: the engine's sampling logprobs are the trainer's, bit for
    # bit, at every step.
    assert set(metrics["sampling/sampling_logp_difference/max"]) == {0.0}
    for key in ("min", "mean", "max"):
        assert set(metrics[f"sampling/importance_sampling_ratio/{key}"]) == {1.0}
    assert "importance-sampling ratio" in result.stdout
    assert "bit for bit, at every step (IS ratio exactly 1, difference exactly 0): yes" in (
        result.stdout)
    for name in ("reward_curve.png", "memory_timeline.png"):
        assert (tmp_path / name).stat().st_size > 10_000
        assert f"wrote {tmp_path / name}" in result.stdout
    timeline = json.loads((tmp_path / "memory_timeline.json").read_text())
    assert set(timeline["rss_bytes"]) == {"trainer", "engine"}
    assert timeline["summary"]["samples_per_s"] >= 20
    # The engine's pools leave at every sleep (level 2: weights and KV cache, 256 MiB of KV).
    assert timeline["summary"]["pool_bytes_released_per_sleep"] >= 256 * 2**20
    names = {p["name"] for p in timeline["phases"]}
    assert {"generate", "sleep", "train", "wake_weights", "weight_sync", "wake_kv_cache"} <= names
