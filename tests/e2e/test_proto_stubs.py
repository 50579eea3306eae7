"""The generated gRPC stubs are what `python scripts/gen_proto.py` produces today."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.server_process import REPO_ROOT


def test_stubs_are_up_to_date():
    pytest.importorskip("grpc_tools", reason="grpcio-tools generates the stubs")
    result = subprocess.run(
        [sys.executable, "scripts/gen_proto.py", "--check"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_client_side_never_imports_the_engine():
    """trainer_bridge shares the engine's wire types and codec, and its chat parsers (pure
    Python), and nothing else of it."""
    code = (
        "import sys, trainer_bridge, trainer_bridge.client, trainer_bridge.transports\n"
        "shared = ('rollout_engine.protocol', 'rollout_engine.parsing')\n"
        "engine = [m for m in sys.modules if m.startswith('rollout_engine')\n"
        "          and m != 'rollout_engine' and not m.startswith(shared)]\n"
        "assert not engine, f'engine imported: {engine}'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=120)


def test_non_loopback_bind_needs_a_token():
    result = subprocess.run(
        [sys.executable, "-m", "rollout_engine.cli", "serve", "--model", "/nonexistent",
         "--host", "0.0.0.0", "--port", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 2
    assert "--auth-token" in result.stderr and "--allow-insecure-remote" in result.stderr
