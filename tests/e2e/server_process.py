"""Starts and stops a real `rollout-engine serve` process for the end-to-end tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from rollout_engine.worker.cpu_threads import cpu_seconds

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_LINE = re.compile(r"rollout-engine serving .* on (\S+):(\d+)")
HTTP_READY_LINE = re.compile(r"rollout-engine HTTP .* on (http://\S+)")
"""Printed before READY_LINE when the server was started with --http-port."""
# Options shared by the served engine and the in-process reference engine.
ENGINE_OPTIONS = {"kv_cache_bytes": 8 * 1024**2, "max_model_len": 256}
STARTUP_TIMEOUT_S = 120.0
AUTH_TOKEN = "e2e-secret-token"
AUTH = (("authorization", f"Bearer {AUTH_TOKEN}"),)
"""Call metadata for the raw stub."""


def engine_flags(options: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]


class ServerProcess:
    """`python -m rollout_engine.cli serve` on 127.0.0.1:0; the ready line gives the address."""

    def __init__(
        self, model_dir: Path, log_path: Path, *extra_args: str, env: dict[str, str] | None = None
    ) -> None:
        self.log_path = log_path
        command = [
            sys.executable, "-m", "rollout_engine.cli", "serve", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", "0", *engine_flags(ENGINE_OPTIONS), *extra_args,
        ]
        env = {**os.environ, **(env or {})}
        python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.update(PYTHONPATH=python_path, PYTHONUNBUFFERED="1")
        # A file, not a pipe: the server never blocks on output nobody reads.
        self._log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
        self.process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.address = self._wait_ready()
        http_match = HTTP_READY_LINE.search(self.log_path.read_text())
        self.http_url: str | None = http_match.group(1) if http_match else None
        """The HTTP API's base URL (`http://127.0.0.1:PORT`) with --http-port, else None."""

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            match = READY_LINE.search(self.log_path.read_text())
            if match:
                return f"{match.group(1)}:{match.group(2)}"
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        self.process.kill()
        raise RuntimeError(f"server did not start:\n{self.log_path.read_text()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text()

    def cpu_time_s(self) -> float:
        """User + system CPU seconds the server process has used so far."""
        return cpu_seconds(f"/proc/{self.process.pid}/stat")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then the exit status (the server drains and exits 0)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        finally:
            self._log.close()


def start_server(
    tmp_path_factory, model_dir: Path, *extra_args: str, env: dict[str, str] | None = None
) -> ServerProcess:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    return ServerProcess(model_dir, log_path, *extra_args, env=env)


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.05):
    """Poll until `predicate()` is truthy; its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
