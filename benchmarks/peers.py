"""Competitors that live in venvs of their own (`make peers`): run them side by side with the
engine from a benchmark, or say why not. Scripts import it as a sibling (`from peers import
...`)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO_ROOT / ".peers" / "vllm" / "bin" / "python"
_VLLM_SCRIPT = Path(__file__).resolve().parent / "peers" / "vllm_generate.py"


def vllm_available() -> bool:
    return VLLM_PYTHON.exists()


def vllm_missing_note() -> str:
    return f"vLLM's CPU build is not installed ({VLLM_PYTHON} missing): `make peers` adds it"


def run_vllm(
    model_dir: str,
    prompts: list[list[int]],
    *,
    n: int,
    max_tokens: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    threads: int | None = None,
    repeats: int = 1,
    kv_cache_gib: int = 4,
    timeout_s: float = 3600.0,
) -> dict:
    """{"elapsed_s": [one per repeat], "num_tokens": N, "version": ...} of vLLM generating the
    same workload (unseeded, EOS ignored) in a child process of its own venv."""
    job = {"model": model_dir, "prompts": prompts, "n": n, "max_tokens": max_tokens,
           "max_model_len": max_model_len, "max_num_batched_tokens": max_num_batched_tokens,
           "threads": threads, "repeats": repeats, "max_num_seqs": max(256, len(prompts) * n),
           "kv_cache_gib": kv_cache_gib}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(job, f)
        f.flush()
        result = subprocess.run([str(VLLM_PYTHON), str(_VLLM_SCRIPT), f.name],
                                capture_output=True, text=True, timeout=timeout_s, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"vLLM failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
