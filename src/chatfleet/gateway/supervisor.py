"""Keeps `chatfleet serve`'s engines running: a replica process that dies is started again.

A thread polls the launcher's processes. When one has exited, it is logged (exit code) and
started again on its own port after a backoff that doubles from ``min_backoff_s`` up to
``max_backoff_s``; the backoff returns to its minimum once a replica has run ``stable_s``
without dying. The gateway's health checks take the replica out of rotation meanwhile and
back in once it answers, so the hash ring (and the sessions homed there) never changes.
``states()`` feeds ``/gateway/status``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from chatfleet.engine.launcher import Fleet
from chatfleet.errors import ConfigError

log = logging.getLogger("chatfleet.gateway")


@dataclass(frozen=True)
class ProcessState:
    """One replica process as the supervisor sees it."""

    pid: int | None
    running: bool
    restarts: int = 0
    last_exit_code: int | None = None
    next_restart_in_s: float | None = None  # while waiting out the backoff
    last_error: str | None = None  # a restart that failed to start a process


@dataclass(frozen=True)
class BackoffPolicy:
    min_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0  # running this long resets the backoff

    def __post_init__(self) -> None:
        if not 0 < self.min_backoff_s <= self.max_backoff_s:
            raise ConfigError("need 0 < min_backoff_s <= max_backoff_s")
        if self.stable_s <= 0:
            raise ConfigError("stable_s must be > 0")


class ReplicaSupervisor:
    def __init__(self, fleet: Fleet, policy: BackoffPolicy = BackoffPolicy(), poll_s: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fleet = fleet
        self.policy = policy
        self.poll_s = poll_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        now = clock()
        self._states = {url: ProcessState(pid=p.pid, running=True)
                        for url, p in zip(fleet.urls, fleet.processes, strict=True)}
        self._backoff = {url: policy.min_backoff_s for url in fleet.urls}
        self._started_at = {url: now for url in fleet.urls}
        self._due: dict[str, float] = {}  # url -> when to restart it

    def states(self) -> dict[str, ProcessState]:
        with self._lock:
            now = self._clock()
            return {url: replace(s, next_restart_in_s=round(max(0.0, self._due[url] - now), 3))
                    if url in self._due else s for url, s in self._states.items()}

    def start(self) -> ReplicaSupervisor:
        self._thread = threading.Thread(target=self._run, name="chatfleet-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop restarting (before the fleet itself is stopped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # never let the supervisor die
                log.exception("replica supervisor round failed")

    def poll(self) -> None:
        """One round: notice exits, restart those whose backoff is over."""
        now = self._clock()
        for index, url in enumerate(self.fleet.urls):
            proc = self.fleet.processes[index]
            with self._lock:
                state = self._states[url]
                if state.running and proc.poll() is not None:
                    self._exited(url, proc.returncode, now)
                elif state.running and now - self._started_at[url] >= self.policy.stable_s:
                    self._backoff[url] = self.policy.min_backoff_s
                if url in self._due and now >= self._due[url] and not self._stop.is_set():
                    self._restart(index, url, now)

    def _exited(self, url: str, code: int | None, now: float) -> None:
        delay = self._backoff[url]
        self._backoff[url] = min(delay * 2, self.policy.max_backoff_s)
        self._due[url] = now + delay
        self._states[url] = replace(self._states[url], running=False, pid=None, last_exit_code=code)
        log.warning("replica process exited", extra={"replica": url, "exit_code": code,
                                                     "restart_in_s": delay})

    def _restart(self, index: int, url: str, now: float) -> None:
        del self._due[url]
        state = self._states[url]
        try:
            proc = self.fleet.restart(index, die_with_thread=True)  # this thread lives as long as serve
        except Exception as exc:  # e.g. the port is taken: try again after a longer backoff
            self._states[url] = replace(state, last_error=str(exc))
            self._exited(url, state.last_exit_code, now)
            return
        self._started_at[url] = now
        self._states[url] = replace(state, pid=proc.pid, running=True, restarts=state.restarts + 1,
                                    last_error=None)
        log.warning("replica process restarted", extra={"replica": url, "pid": proc.pid,
                                                        "restarts": state.restarts + 1})
