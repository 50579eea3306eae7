"""Our top-level `kernels` package shares its import name with Hugging Face's `kernels`.

transformers probes for that distribution (`is_kernels_available`) and, if it believes
it found it, imports hub-kernel helpers from it at import time. Each test runs in a fresh
interpreter so that neither module is already cached.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

CHECK_SCRIPT = """
import sys
from pathlib import Path

repo_root = Path(sys.argv[1]).resolve()
model_dir = sys.argv[2]
order = sys.argv[3]

if order == "ours_first":
    import kernels
import transformers
import kernels

where = [Path(p).resolve() for p in getattr(kernels, "__path__", [])]
assert repo_root / "kernels" in where, f"imported another kernels package: {where}"

from transformers.utils import import_utils

assert not import_utils.is_kernels_available(), (
    "transformers takes our kernels package for Hugging Face's: "
    f"{import_utils._is_package_available('kernels', return_version=True)}"
)
import transformers.integrations.hub_kernels  # noqa: F401  (imports from HF kernels if fooled)

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from rollout_engine.tiny_model import build_tiny_model

build_tiny_model(model_dir, "llama")
model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
tokenizer = AutoTokenizer.from_pretrained(model_dir)
input_ids = tokenizer("The people said", return_tensors="pt")["input_ids"]
with torch.no_grad():
    logits = model(input_ids).logits  # [1, num_tokens, vocab]
assert logits.shape == (1, input_ids.shape[1], model.config.vocab_size), logits.shape
assert torch.isfinite(logits).all()
output_ids = model.generate(input_ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
assert output_ids.shape == (1, input_ids.shape[1] + 4), output_ids.shape
assert output_ids[0, input_ids.shape[1]].item() == logits[0, -1].argmax().item()
print("OK", output_ids[0].tolist())
"""


def run_check(tmp_path: Path, order: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["HF_HUB_OFFLINE"] = "1"
    script = textwrap.dedent(CHECK_SCRIPT)
    argv = [sys.executable, "-c", script, str(REPO_ROOT), str(tmp_path / "model"), order]
    return subprocess.run(
        argv, check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("order", [  # ours first is the order that can shadow HF's `kernels`
    "ours_first", pytest.param("transformers_first", marks=pytest.mark.slow)])
def test_transformers_works_next_to_our_kernels_package(tmp_path: Path, order: str) -> None:
    result = run_check(tmp_path, order)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.stdout.startswith("OK "), result.stdout
