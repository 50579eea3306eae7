"""The layering of DESIGN's layout table, checked where it is easiest to break: the engine
never imports the server (only the CLI does), the core imports no torch, the server reaches the
engine only through its front door, every source file has a name of its own and stays short."""

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


SOURCE_PACKAGES = ("rollout_engine", "trainer_bridge", "memory", "kernels")
GENERATED = {"protos/rollout_pb2.py", "protos/rollout_pb2_grpc.py"}
MAX_SOURCE_LINES = 500


def source_files() -> list[Path]:
    return sorted(path for package in SOURCE_PACKAGES
                  for path in (REPO_ROOT / package).rglob("*.py") if "__pycache__" not in path.parts)


def test_only_the_front_door_names_the_engine_in_the_server():
    """gRPC, HTTP and the weight receiver hold an `AsyncEngine`; only it and its loop name the
    `LLMEngine` they drive."""
    door = {"rollout_engine/server/async_engine.py", "rollout_engine/server/engine_loop.py"}
    naming = [path.relative_to(REPO_ROOT).as_posix()
              for path in (REPO_ROOT / "rollout_engine/server").rglob("*.py")
              if "LLMEngine" in path.read_text()]
    assert sorted(set(naming) - door) == []


def test_the_engine_imports_no_server():
    importers = [path.relative_to(REPO_ROOT).as_posix()
                 for folder in ("rollout_engine/engine", "rollout_engine/core",
                                "rollout_engine/worker")
                 for path in (REPO_ROOT / folder).rglob("*.py")
                 if "rollout_engine.server" in path.read_text()]
    assert importers == []


def test_no_source_file_name_is_used_twice():
    """One name per file across the packages (package `__init__`s aside): a name says where."""
    seen: dict[str, list[str]] = {}
    for path in source_files():
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(path.relative_to(REPO_ROOT).as_posix())
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_no_source_file_is_longer_than_it_can_stay_one_thing():
    too_long = {}
    for path in [*source_files(), *(REPO_ROOT / "protos").glob("*.py")]:
        relative = path.relative_to(REPO_ROOT).as_posix()
        num_lines = len(path.read_text().splitlines())
        if relative not in GENERATED and num_lines > MAX_SOURCE_LINES:
            too_long[relative] = num_lines
    assert too_long == {}
