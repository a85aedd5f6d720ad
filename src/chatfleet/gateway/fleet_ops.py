"""Fleet operations through the gateway: the prefix-cache reset of every replica, calls that pass
through to one replica (``GET /v1/models/{id}``, ``POST /tokenize``), and where the replicas'
own metrics are scraped.

``reset_fleet`` posts ``/reset_prefix_cache`` to every member (draining ones too: they still
hold cached blocks) at once and reports each: ``{"success", "prefix_cache_empty", "replicas":
[{"url", "status", "success", "prefix_cache_empty", "error"}]}``; HTTP 200 when every replica
emptied its cache, else 502 with the same report, so a sweep knows which replica failed.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import aiohttp

from chatfleet.gateway.admission import AdmissionController
from chatfleet.gateway.config import GatewayConfig
from chatfleet.gateway.replicas import ReplicaSet

RESET_PATH = "/reset_prefix_cache"
RESET_TIMEOUT_S = 60.0


class FleetContext(Protocol):
    config: GatewayConfig
    replicas: ReplicaSet
    admission: AdmissionController
    sessions: dict[str, aiohttp.ClientSession]


@dataclass(frozen=True)
class ReplicaReset:
    url: str
    status: int | None  # None: no HTTP answer
    success: bool
    prefix_cache_empty: bool | None
    error: str | None = None


@dataclass(frozen=True)
class FleetReset:
    replicas: tuple[ReplicaReset, ...]

    @property
    def success(self) -> bool:
        return bool(self.replicas) and all(r.success for r in self.replicas)

    def to_dict(self) -> dict[str, Any]:
        return {"success": self.success, "prefix_cache_empty": self.success,
                "replicas": [asdict(r) for r in self.replicas]}


def upstream_auth(config: GatewayConfig) -> dict[str, str]:
    return {"authorization": f"Bearer {config.upstream_api_key}"} if config.upstream_api_key else {}


async def _reset_one(ctx: FleetContext, url: str) -> ReplicaReset:
    session = ctx.sessions.get(url)
    if session is None:
        return ReplicaReset(url, None, False, None, "no upstream client (the replica left)")
    try:
        async with session.post(url + RESET_PATH, headers=upstream_auth(ctx.config),
                                timeout=aiohttp.ClientTimeout(total=RESET_TIMEOUT_S)) as resp:
            text = await resp.text()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        return ReplicaReset(url, None, False, None, f"{type(exc).__name__}: {exc}")
    if status != 200:
        return ReplicaReset(url, status, False, None, f"answered HTTP {status}: {text[:200]}")
    try:
        body = json.loads(text)
    except ValueError:
        body = {}
    empty = body.get("prefix_cache_empty", body.get("success")) if isinstance(body, dict) else None
    ok = empty is not False and (not isinstance(body, dict) or body.get("success") is not False)
    return ReplicaReset(url, status, ok, None if empty is None else bool(empty),
                        None if ok else f"answered 200 but kept its cache: {text[:200]}")


async def reset_fleet(ctx: FleetContext) -> FleetReset:
    """Reset every replica's prefix cache at once; one report per replica, sorted by URL."""
    urls = sorted(ctx.replicas.urls)
    return FleetReset(tuple(await asyncio.gather(*(_reset_one(ctx, url) for url in urls))))


def pass_through_replica(ctx: FleetContext, model: str | None = None) -> str | None:
    """A routable replica for a call any replica can answer: one serving ``model`` if known,
    the least loaded first; None when none is routable."""
    healthy = ctx.replicas.healthy()
    if model is not None:
        serving = [u for u in healthy if any(m.get("id") == model for m in ctx.replicas[u].models)]
        healthy = serving or healthy
    loads = ctx.admission.loads()
    return min(healthy, key=lambda u: (loads.get(u, 0), u), default=None)


def scrape_note(ctx: FleetContext) -> bytes:
    """Prometheus comment lines (ignored by parsers) naming where each replica's series are."""
    lines = ["# The replicas' own series (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ...) are",
             "# on each replica's /metrics; scrape them there (a Prometheus http_sd_config on this",
             "# gateway's /gateway/targets lists them, or the engines' PodMonitor on Kubernetes):"]
    lines += [f"#   {url}/metrics" for url in sorted(ctx.replicas.urls)]
    return ("\n".join(lines) + "\n").encode()


def scrape_targets(ctx: FleetContext) -> list[dict[str, Any]]:
    """Prometheus HTTP service discovery: one target group, every replica (host:port)."""
    targets = [url.split("://", 1)[1].split("/", 1)[0] for url in sorted(ctx.replicas.urls)]
    return [{"targets": targets, "labels": {"job": "chatfleet-engine", "__metrics_path__": "/metrics"}}]


@dataclass(frozen=True)
class Forwarded:
    status: int
    body: bytes
    content_type: str


async def forward(ctx: FleetContext, url: str, method: str, path: str, body: bytes | None,
                  headers: dict[str, str]) -> Forwarded | None:
    """One plain call to ``url`` (no retries: the callers are cheap to repeat); None when the
    replica did not answer."""
    session = ctx.sessions.get(url)
    if session is None:
        return None
    try:
        async with session.request(method, url + path, data=body, headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=ctx.config.health_timeout_s * 5)) as resp:
            return Forwarded(resp.status, await resp.read(), resp.headers.get("content-type", "application/json"))
    except (aiohttp.ClientError, TimeoutError):
        return None
