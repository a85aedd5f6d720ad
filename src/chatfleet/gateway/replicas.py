"""The replica set: health from active checks and passive error counting, down and rejoin.

A replica is down after ``failure_threshold`` consecutive failures, counting failed health
checks and failed proxied calls alike (or at once when its first health check fails); one
passing health check brings it back (rejoin). Going
down hands its queued requests back to routing (``on_down``); the hash ring never changes, so a
dead replica's sessions move to the next replica clockwise and come home when it rejoins.

Membership changes with discovery (``--replicas-from``): ``join`` adds a replica (routable once
its first health check passes), ``drain`` takes one out of routing while its in-flight requests
finish (its waiters go back to routing through ``on_down``), ``forget`` drops it once idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("chatfleet.gateway")


@dataclass
class ReplicaStats:
    """Counters of one replica, exported by gateway.metrics."""

    requests: int = 0  # responses started (any status)
    retried: int = 0  # requests that failed here before their first byte and went elsewhere
    shed: int = 0  # 429s for requests routed here
    shed_new: int = 0  # ... of them first turns of new conversations
    shed_returning: int = 0  # ... of them returning turns of conversations in progress
    affinity_kept: int = 0
    affinity_broken: int = 0  # sessions whose home is this replica, served elsewhere
    stream_breaks: int = 0  # streams that broke after the first byte
    upstream_errors: int = 0  # failed calls (connect, timeout, 5xx, broken stream)
    marked_down: int = 0
    rejoined: int = 0


@dataclass
class Replica:
    url: str
    healthy: bool = True
    consecutive_failures: int = 0
    last_error: str | None = None
    last_change: float = field(default_factory=time.monotonic)
    models: tuple[dict[str, Any], ...] = ()  # the replica's /v1/models entries
    checked: bool = False  # a replica failing its very first health check starts down
    draining: bool = False  # left the discovered set: finishes what it has, takes nothing new
    stats: ReplicaStats = field(default_factory=ReplicaStats)


class ReplicaSet:
    def __init__(self, urls: Iterable[str], *, failure_threshold: int, health_interval_s: float,
                 health_timeout_s: float, headers: dict[str, str] | None = None,
                 on_down: Callable[[str], object] | None = None) -> None:
        self.replicas = {url: Replica(url) for url in urls}
        self.failure_threshold = failure_threshold
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.on_down = on_down
        self._headers = headers or {}
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._soon: dict[str, asyncio.Task[None]] = {}  # extra health checks asked for, one per replica

    @property
    def started(self) -> bool:
        return self._client is not None

    @property
    def urls(self) -> list[str]:
        return list(self.replicas)

    def healthy(self) -> list[str]:
        """Routable replicas: healthy and not draining."""
        return [url for url, r in self.replicas.items() if r.healthy and not r.draining]

    # -- membership --------------------------------------------------------------------------
    def join(self, url: str) -> bool:
        """Add ``url`` (down until its first health check passes), or stop draining it.
        True when it was not a member before."""
        replica = self.replicas.get(url)
        if replica is not None:
            if replica.draining:
                replica.draining = False
                log.info("replica back in the discovered set", extra={"replica": url})
            return False
        self.replicas[url] = Replica(url, healthy=False)
        log.info("replica joined", extra={"replica": url})
        return True

    def drain(self, url: str) -> None:
        """Take ``url`` out of routing; what it serves now finishes there."""
        replica = self.replicas[url]
        if replica.draining:
            return
        replica.draining = True
        log.info("replica draining", extra={"replica": url})
        if self.on_down is not None:
            self.on_down(url)

    def forget(self, url: str) -> None:
        self.replicas.pop(url, None)
        task = self._soon.pop(url, None)
        if task is not None:
            task.cancel()

    def __getitem__(self, url: str) -> Replica:
        return self.replicas[url]

    # -- passive -----------------------------------------------------------------------------
    def record_success(self, url: str) -> None:
        self.replicas[url].consecutive_failures = 0

    def record_failure(self, url: str, error: str) -> None:
        replica = self.replicas[url]
        replica.stats.upstream_errors += 1
        replica.consecutive_failures += 1
        replica.last_error = error
        if replica.healthy and replica.consecutive_failures >= self.failure_threshold:
            self._set_health(replica, False)

    def _set_health(self, replica: Replica, healthy: bool) -> None:
        replica.healthy = healthy
        replica.last_change = time.monotonic()
        if healthy:
            replica.consecutive_failures = 0
            replica.stats.rejoined += 1
            log.info("replica rejoined", extra={"replica": replica.url})
        else:
            replica.stats.marked_down += 1
            log.warning("replica down", extra={"replica": replica.url, "error": replica.last_error})
            if self.on_down is not None:
                self.on_down(replica.url)

    # -- active ------------------------------------------------------------------------------
    async def check(self, url: str) -> bool:
        """One health check of ``url``; updates its state. Fetches its models on (re)joining."""
        replica = self.replicas[url]
        assert self._client is not None, "start() the replica set first"
        try:
            resp = await self._client.get(url + "/health")
            ok = resp.status_code == 200
            error = None if ok else f"health check answered {resp.status_code}"
        except httpx.HTTPError as exc:
            ok, error = False, f"health check failed: {type(exc).__name__}: {exc}"
        if self.replicas.get(url) is not replica:
            return ok  # forgotten while the check ran
        if ok and not replica.checked:  # a replica that joined: routable from now on, not a rejoin
            await self._fetch_models(replica)
            replica.healthy, replica.checked, replica.consecutive_failures = True, True, 0
            replica.last_change = time.monotonic()
            return ok
        if ok:
            if not replica.healthy or not replica.models:
                await self._fetch_models(replica)
            replica.consecutive_failures = 0
            if not replica.healthy:
                self._set_health(replica, True)
        else:
            self.record_failure(url, error or "unhealthy")
            if not replica.checked and replica.healthy:
                self._set_health(replica, False)
        replica.checked = True
        return ok

    async def _fetch_models(self, replica: Replica) -> None:
        assert self._client is not None, "start() the replica set first"
        try:
            resp = await self._client.get(replica.url + "/v1/models")
            data = resp.json().get("data") if resp.status_code == 200 else None
            if isinstance(data, list):
                replica.models = tuple(m for m in data if isinstance(m, dict) and "id" in m)
        except (httpx.HTTPError, ValueError, AttributeError):
            pass  # models are a convenience; health decides routing

    def check_soon(self, url: str) -> None:
        """Check ``url``'s health now, off the request path (at most one extra check at a time)."""
        if self._client is None or url in self._soon:
            return
        task = asyncio.get_running_loop().create_task(self._check_quietly(url))
        self._soon[url] = task
        task.add_done_callback(lambda _: self._soon.pop(url, None))

    async def _check_quietly(self, url: str) -> None:
        try:
            await self.check(url)
        except Exception:  # the periodic checks go on regardless
            log.exception("health check of %s failed", url)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(url) for url, r in list(self.replicas.items()) if not r.draining))

    async def start(self) -> None:
        """Open the health-check client, run one round, then keep checking in the background."""
        self._client = httpx.AsyncClient(
            timeout=self.health_timeout_s, headers=self._headers,
            limits=httpx.Limits(max_connections=4 * len(self.replicas) + 64),
        )
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="chatfleet-health-checks")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # never let the checker die
                log.exception("health check round failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for task in list(self._soon.values()):
            task.cancel()
        await asyncio.gather(*self._soon.values(), return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def models(self) -> list[dict[str, Any]]:
        """Models served by healthy replicas, each id once."""
        seen: dict[str, dict[str, Any]] = {}
        for replica in self.replicas.values():
            if replica.healthy:
                for model in replica.models:
                    seen.setdefault(model["id"], model)
        return list(seen.values())
