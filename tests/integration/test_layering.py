"""The layering of DESIGN's layout table, checked where it is easiest to break: the engine
never imports the server (only the CLI does), and the core imports no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def modules_after(code: str) -> set[str]:
    script = f"import sys\n{code}\nprint('\\n'.join(sys.modules))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=False, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    return set(result.stdout.split())


def test_an_engine_with_every_kv_transport_does_not_import_the_server(tmp_path):
    loaded = modules_after(
        "from rollout_engine import LLM, SamplingParams\n"
        "from rollout_engine.tiny_model import build_tiny_model\n"
        f"llm = LLM(str(build_tiny_model({str(tmp_path / 'm')!r})), kv_role='both')\n"
        "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))"
    )
    assert "rollout_engine.engine.kv_connector" in loaded
    assert not {m for m in loaded if m.startswith("rollout_engine.server")}


def test_the_core_imports_no_torch():
    loaded = modules_after(
        "import rollout_engine.core.scheduler, rollout_engine.core.kv_connector_scheduler, "
        "rollout_engine.core.spec_decode"
    )
    assert "rollout_engine.core.scheduler" in loaded and "torch" not in loaded


def test_only_the_server_imports_the_http_front_end():
    """`rollout_engine.server.http` (FastAPI) is the server's: the engine, the trainer side and
    the scripts never import it; importing `trainer_bridge` or the CLI loads no FastAPI."""
    importers = []
    for folder in ("rollout_engine", "trainer_bridge", "kernels", "memory", "examples",
                   "benchmarks"):
        for path in (REPO_ROOT / folder).rglob("*.py"):
            relative = path.relative_to(REPO_ROOT).as_posix()
            if relative.startswith("rollout_engine/server/"):
                continue
            if "rollout_engine.server.http" in path.read_text() or "fastapi" in path.read_text():
                importers.append(relative)
    assert importers == []
    loaded = modules_after("import trainer_bridge, rollout_engine.cli")
    assert "fastapi" not in loaded and "rollout_engine.server.http" not in loaded
