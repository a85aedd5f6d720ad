"""The one engine launcher: N engine processes (``python -m chatfleet.engine``) on one machine.

Used by `chatfleet serve` (a local fleet behind the gateway), `chatfleet demo`, the benchmarks,
the gate and the tests. Each engine's command line is written from its ``EngineConfig`` and
``EngineServer`` by ``engine/argv.py`` (``FleetConfig.engine_args``: ``chatfleet engine`` flags
applied on top, checked when the config is made). Each engine gets its own port and an equal
share of the CPU cores as torch threads; the launcher waits for every ``/health`` before
returning, and stops them all (SIGTERM, then SIGKILL after a grace period) however the caller
ends. On Linux, engines started from the main thread also die with the parent process (the
kernel ties that signal to the starting thread, so engines started from a worker thread would
die with the thread instead: they do not get it). With ``log_dir`` set, each engine's output
goes to a file whose tail is quoted when it fails.

Each engine leads a process group of its own (a terminal's Ctrl-C reaches only the caller, which
stops the engines) but stays in the caller's session: Linux schedules each session as one group
(autogroup), so an engine in a session of its own would take an equal share of the CPU against
the gateway whatever its processes' priorities, and its niced tokenizing worker
(``protocol.worker_priority``) would stall the gateway's streams instead of yielding to them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from chatfleet.engine.api.options import ServerOptions
from chatfleet.engine.argv import EngineServer, engine_argv, with_flags
from chatfleet.engine.config import EngineConfig
from chatfleet.errors import ChatfleetError, ConfigError
from chatfleet.loopback import free_port


@dataclass(frozen=True)
class FleetConfig:
    replicas: int = 2  # engine processes to start
    model: str = "tiny"
    host: str = "127.0.0.1"
    base_port: int | None = None  # engines on base_port, base_port+1, ...; None: free ports
    threads_per_replica: int | None = None  # None: the machine's cores split evenly
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 15.0
    engine_args: tuple[str, ...] = ()  # extra `chatfleet engine` flags (engine/argv.py FLAGS)
    extra_env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None  # None: engines write to this process's stdout/stderr
    log_name: str = "engine"  # log file LOG_DIR/NAME.log (one engine) or NAME-I.log

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ConfigError("replicas must be >= 0")
        if self.base_port is not None and not 0 < self.base_port < 65536 - self.replicas:
            raise ConfigError(f"base_port {self.base_port} leaves no room for {self.replicas} engines")
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise ConfigError("threads_per_replica must be >= 1")
        if self.startup_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ConfigError("timeouts must be > 0")
        reserved = {"--model", "--port", "--host", "--threads"}
        clash = sorted(a.split("=")[0] for a in self.engine_args if a.split("=")[0] in reserved)
        if clash:
            raise ConfigError(f"engine args {clash} are set by the fleet; use its own options")
        self.engine()  # the flags and the config they give are checked now, not in the engines

    def engine(self, port: int = 0) -> tuple[EngineConfig, EngineServer]:
        """The config and server settings of the engine on ``port``: the fleet's model, threads,
        host, warning-level logs and admin routes, then ``engine_args`` on top."""
        base = EngineConfig(model=self.model, num_threads=self.threads())
        server = EngineServer(host=self.host, port=port, log_level="warning",
                              options=ServerOptions(enable_admin_api=True))
        return with_flags(base, server, self.engine_args)

    def threads(self) -> int:
        if self.threads_per_replica is not None:
            return self.threads_per_replica
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, cores // max(1, self.replicas))

    def log_path(self, index: int) -> Path | None:
        if self.log_dir is None:
            return None
        name = self.log_name if self.replicas == 1 else f"{self.log_name}-{index}"
        return Path(self.log_dir) / f"{name}.log"

    @staticmethod
    def engine_flags(section: dict[str, Any]) -> tuple[str, ...]:
        """A profile's ``engine:`` mapping as flags: {kv_cache_tokens: 4096} -> --kv-cache-tokens 4096."""
        flags: list[str] = []
        for key, value in section.items():
            flag = "--" + str(key).replace("_", "-")
            if value is True:
                flags.append(flag)
            elif value is not False and value is not None:
                flags += [flag, str(value)]
        return tuple(flags)


class FleetError(ChatfleetError):
    """An engine process of the fleet failed to start."""

    error_type = "fleet_error"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Fleet:
    """Start with ``start()`` (returns the URLs) or as a context manager; ``url`` is the first.
    ``prepare_model``: called once with the model name before the engines start (e.g. to build a
    built-in model once here, not N times in the engines)."""

    def __init__(self, config: FleetConfig, prepare_model: Callable[[str], object] | None = None) -> None:
        self.config = config
        self.prepare_model = prepare_model
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.logs: list[Path | None] = []

    @property
    def url(self) -> str:
        if not self.urls:
            raise FleetError("no engine has been started")
        return self.urls[0]

    def command(self, port: int) -> list[str]:
        config, server = self.config.engine(port)
        return [sys.executable, "-m", "chatfleet.engine", *engine_argv(config, server)]

    def start(self) -> list[str]:
        """Start the engines and wait until each answers /health; returns their URLs."""
        cfg = self.config
        if cfg.replicas and self.prepare_model is not None:
            self.prepare_model(cfg.model)
        try:
            for i in range(cfg.replicas):
                port = cfg.base_port + i if cfg.base_port is not None else free_port(cfg.host)
                self.processes.append(self._spawn(i, port))
                self.urls.append(f"http://{cfg.host}:{port}")
                self.logs.append(cfg.log_path(i))
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return list(self.urls)

    def restart(self, index: int, die_with_thread: bool = False) -> subprocess.Popen:
        """Start engine ``index`` again on its own port (after it died); does not wait for it.
        ``die_with_thread``: the engine gets SIGTERM when the calling thread ends (for a
        supervisor thread that lives as long as the process)."""
        old = self.processes[index]
        if old.poll() is None:
            raise FleetError(f"engine {self.urls[index]} is still running")
        port = int(self.urls[index].rsplit(":", 1)[1])
        self.processes[index] = self._spawn(index, port, append_log=True, die_with_thread=die_with_thread)
        return self.processes[index]

    def _spawn(self, index: int, port: int, append_log: bool = False,
               die_with_thread: bool = False) -> subprocess.Popen:
        cfg = self.config
        threads = str(cfg.threads())
        with_parent = sys.platform == "linux" and (
            die_with_thread or threading.current_thread() is threading.main_thread())
        env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, **cfg.extra_env)
        log = cfg.log_path(index)
        out: IO[bytes] | None = None
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            out = open(log, "ab" if append_log else "wb")
        try:
            return subprocess.Popen(
                self.command(port), env=env, process_group=0, stdout=out,
                stderr=subprocess.STDOUT if out else None,
                preexec_fn=_die_with_parent if with_parent else None,
            )
        finally:
            if out is not None:
                out.close()  # the child holds its own descriptor

    def _failure(self, index: int, what: str) -> FleetError:
        log = self.logs[index]
        tail = ""
        if log is not None and log.is_file():
            tail = ": " + log.read_text(errors="replace")[-2000:]
        return FleetError(f"engine {self.urls[index]} {what}{tail}")

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        pending = dict(enumerate(self.processes))
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                for i, proc in list(pending.items()):
                    if proc.poll() is not None:
                        raise self._failure(i, f"exited with code {proc.returncode} while starting")
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(self.urls[i] + "/health").status_code == 200:
                            del pending[i]
                if pending and time.monotonic() > deadline:
                    raise FleetError(f"engines {sorted(self.urls[i] for i in pending)} not healthy after "
                                     f"{self.config.startup_timeout_s:g} s")
                if pending:
                    time.sleep(0.25)

    def stop(self) -> None:
        """SIGTERM every engine, SIGKILL those still alive after the grace period."""
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout_s
        for proc in self.processes:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.processes.clear()

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
