"""Start and stop a `rollout-engine serve` subprocess from the trainer side."""

from __future__ import annotations

import atexit
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

READY_LINE = re.compile(r"rollout-engine serving .* on (\S+):(\d+)")
HTTP_READY_LINE = re.compile(r"rollout-engine HTTP .* on (http://\S+)")
"""Printed just before READY_LINE by a server started with `--http-port`."""
DEFAULT_STARTUP_TIMEOUT_S = 120.0
_LIVE_SERVERS: weakref.WeakSet[EngineServer] = weakref.WeakSet()


class EngineServerError(RuntimeError):
    """The engine server exited or did not print its ready line in time; see `log_tail`."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(f"{message}\n--- server log (tail) ---\n{log_tail}")
        self.log_tail = log_tail


class EngineServer:
    """`python -m rollout_engine.cli serve --model DIR --port 0` in a child process.

    The address comes from the server's ready line; output goes to a log file (never a pipe,
    so the server cannot block on a full pipe). The child is killed when this object is
    stopped, garbage-collected, or when the interpreter exits.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        engine_options: Mapping[str, object] | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    ) -> None:
        self.model_dir = str(model_dir)
        self.command = [
            python, "-m", "rollout_engine.cli", "serve", "--model", self.model_dir,
            "--host", host, "--port", str(port), *option_flags(engine_options or {}), *extra_args,
        ]
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.env["PYTHONPATH"] = _python_path(self.env.get("PYTHONPATH", ""))
        self.startup_timeout_s = startup_timeout_s
        if log_path is None:
            log_dir = tempfile.mkdtemp(prefix="rollout-engine-")
            log_path = os.path.join(log_dir, "server.log")
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None
        self.address = ""
        self.http_url: str | None = None
        """`http://HOST:PORT` of vllm serve's API with `--http-port` in `extra_args`, else None:
        what TRL's `VLLMClient(base_url=...)` and the `openai` package take (+ "/v1")."""
        _LIVE_SERVERS.add(self)
        self.start()

    # ----------------------------------------------------------------------------- control
    def start(self) -> str:
        """Launch the child and wait for its ready line; returns "host:port"."""
        assert self.process is None or self.process.poll() is not None, "already running"
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(
                self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the trainer's terminal is the trainer's
            )
        self.address = self._wait_ready()
        return self.address

    def restart(self) -> str:
        """Kill the child (if alive) and start a fresh one; the port may change."""
        self.kill()
        return self.start()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (the server drains and exits 0), SIGKILL after `timeout_s`; the exit status."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    def kill(self) -> None:
        """SIGKILL the child at once and reap it."""
        process = self.process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    # ------------------------------------------------------------------------ inspection
    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self, num_chars: int = 4000) -> str:
        """The last `num_chars` characters of the server's output."""
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except FileNotFoundError:
            return ""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __del__(self) -> None:
        self.kill()

    # ------------------------------------------------------------------------- internals
    def _wait_ready(self) -> str:
        assert self.process is not None
        start_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            with open(self.log_path, errors="replace") as log:
                log.seek(start_offset)
                text = log.read()
            match = READY_LINE.search(text)
            if match:
                http_match = HTTP_READY_LINE.search(text)
                self.http_url = http_match.group(1) if http_match else None
                return f"{match.group(1)}:{match.group(2)}"
            if self.process.poll() is not None:
                raise EngineServerError(
                    f"the engine server exited with status {self.process.returncode} "
                    f"before it was ready ({' '.join(self.command)})", self.log())
            time.sleep(0.05)
        self.kill()
        raise EngineServerError(
            f"the engine server printed no ready line within {self.startup_timeout_s} s", self.log()
        )


def option_flags(options: Mapping[str, object]) -> list[str]:
    """{"kv_cache_bytes": 1024} -> ["--kv-cache-bytes=1024"]; True -> a bare flag, None/False -> none."""
    flags = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not None and value is not False:
            flags.append(f"{flag}={value}")
    return flags


def _python_path(current: str) -> str:
    """`current` plus the folder holding the `rollout_engine` package this interpreter would
    import (found without importing it), so the child finds it from any working directory."""
    spec = importlib.util.find_spec("rollout_engine")
    if spec is None or not spec.submodule_search_locations:
        return current
    root = str(Path(next(iter(spec.submodule_search_locations))).parent)
    parts = [p for p in current.split(os.pathsep) if p]
    return os.pathsep.join(parts if root in parts else [root, *parts])


@atexit.register
def _kill_live_servers() -> None:
    for server in list(_LIVE_SERVERS):
        server.kill()
