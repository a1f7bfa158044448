"""A `specserve serve` process of our own on a free loopback port: for tests, and for
benchmarks that start the servers they measure."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specserve.errors import SpecserveError

CLI_ERROR = "specserve: error: "  # how the CLI prints a SpecserveError


class ServerStartError(SpecserveError):
    """The server exited during start-up, or never became healthy."""

    def __init__(self, reason: str, log: str):
        # The server's own one-line error where it printed one (a bad flag, an unknown
        # model), else the end of its log.
        lines = log.strip().splitlines()
        said = lines[-1].removeprefix(CLI_ERROR) if lines and lines[-1].startswith(CLI_ERROR) else None
        detail = said or "\n".join(lines[-20:])
        super().__init__(f"the server {reason}: {detail}")
        self.log = log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """The server's output goes to a temporary file, removed once the process is stopped;
    `log()` still returns it after that."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, startup_timeout_s: float = 180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="specserve-server-", suffix=".log")[1])
        self._stopped_log: str | None = None
        command = [
            sys.executable,
            "-m",
            "specserve.cli",
            "serve",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.process.poll() is not None:
                self.stop()
                raise ServerStartError("exited during start-up", self.log())
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"was not healthy after {startup_timeout_s:.0f} s", self.log())
            time.sleep(0.2)

    def log(self) -> str:
        if self._stopped_log is not None:
            return self._stopped_log
        return self.log_path.read_text()

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._stopped_log is None:
            self._stopped_log = self.log_path.read_text()
            self.log_path.unlink(missing_ok=True)
