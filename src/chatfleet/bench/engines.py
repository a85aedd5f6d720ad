"""Start the built-in engine in a subprocess on a free loopback port (for `demo` and tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from chatfleet.errors import ChatfleetError
from chatfleet.loopback import free_port


@dataclass
class EngineProcess:
    """``chatfleet engine --model MODEL <args>`` on 127.0.0.1; a context manager."""

    model: str
    args: list[str] = field(default_factory=list)
    threads: int = 1
    startup_timeout_s: float = 180.0
    log_path: Path | None = None
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "EngineProcess":
        self.port = self.port or free_port()
        cmd = [sys.executable, "-m", "chatfleet.cli.main", "engine", "--model", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), "--threads", str(self.threads), "--log-level", "warning", *self.args]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="chatfleet-engine-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.log_path.read_text(errors="replace")[-2000:]
                raise ChatfleetError(f"engine exited with code {self.proc.returncode}: {err}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise ChatfleetError(f"engine did not answer on {self.url} within {self.startup_timeout_s:g}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def __enter__(self) -> "EngineProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
