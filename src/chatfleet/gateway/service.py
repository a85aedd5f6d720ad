"""The gateway's state: replicas, router, admission, metrics and upstream clients, and the
request handling that turns an HTTP request into a ``ProxyResponse``. ``app.py`` wires it into
FastAPI; ``proxy.py`` runs each proxied call against it.
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import aiohttp
from fastapi import Request

from chatfleet.errors import (
    AuthenticationError,
    ConfigError,
    InvalidRequestError,
    ModelNotFoundError,
    PayloadTooLargeError,
)
from chatfleet.gateway.admission import AdmissionController
from chatfleet.gateway.body import ENDPOINTS, BodyInspector, BodyRejected, ParsedBody
from chatfleet.gateway.config import GatewayConfig
from chatfleet.gateway.metrics import GatewayMetrics
from chatfleet.gateway.proxy import ProxyCall, ProxyResponse
from chatfleet.gateway.replicas import ReplicaSet
from chatfleet.gateway.routing import make_routing_policy
from chatfleet.gateway.session import KeySource, SessionKey
from chatfleet.gateway.session_tracker import SessionTracker
from chatfleet.protocol.errors import to_chatfleet_error

if TYPE_CHECKING:
    from chatfleet.gateway.supervisor import ProcessState

__all__ = ["ENDPOINTS", "Gateway"]


class Gateway:
    """Everything one gateway process holds: replicas, router, admission, metrics, clients."""

    def __init__(self, config: GatewayConfig,
                 processes: Callable[[], Mapping[str, ProcessState]] | None = None) -> None:
        if not config.replicas:
            raise ConfigError("the gateway needs at least one replica (--replica URL)")
        self.config = config
        self.processes = processes  # replica processes `serve` supervises, for the status
        urls = [spec.url for spec in config.replicas]
        self.admission = AdmissionController(
            {spec.url: config.cap_of(spec) for spec in config.replicas},
            queue_size=config.queue_size, max_wait_s=config.max_queue_wait_s,
            retry_after_s=config.retry_after_s, max_queued_new=config.new_queue_limit,
        )
        self.sessions_seen = SessionTracker(config.session_ttl_s, config.max_sessions)
        self.bodies = BodyInspector(config.body_offload_bytes)
        upstream_headers = {}
        if config.upstream_api_key:
            upstream_headers["authorization"] = f"Bearer {config.upstream_api_key}"
        self.replicas = ReplicaSet(
            urls, failure_threshold=config.failure_threshold,
            health_interval_s=config.health_interval_s, health_timeout_s=config.health_timeout_s,
            headers=upstream_headers, on_down=self.admission.drain,
        )
        self.router = make_routing_policy(config.routing_policy, urls,
                                          virtual_nodes=config.virtual_nodes,
                                          load_factor=config.load_factor)
        self.metrics = GatewayMetrics(self.replicas, self.admission)
        self.sessions: dict[str, aiohttp.ClientSession] = {}
        self._session_header = config.session_header.lower()

    async def start(self) -> None:
        """Open one upstream connection pool per replica (aiohttp: it stays fast with thousands
        of open streams, where httpx's pool slows down), then start health checks."""
        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=cfg.total_timeout_s, connect=cfg.pool_timeout_s,
                                        sock_connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s)
        for url in self.replicas.urls:
            connector = aiohttp.TCPConnector(limit=cfg.max_connections_per_replica, limit_per_host=0,
                                             keepalive_timeout=4.0)  # < uvicorn's 5 s
            self.sessions[url] = aiohttp.ClientSession(
                connector=connector, timeout=timeout, auto_decompress=False, trust_env=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"))
        await self.replicas.start()

    async def stop(self) -> None:
        await self.replicas.stop()
        for session in self.sessions.values():
            await session.close()
        self.sessions.clear()
        self.bodies.close()

    # -- request handling --------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if not self.config.api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(
            hmac.compare_digest(token.strip().encode(), key.encode()) for key in self.config.api_keys
        ):
            raise AuthenticationError("missing or invalid API key; send 'Authorization: Bearer <key>'")

    async def read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(f"request body of {declared} bytes exceeds the limit of {limit}")
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
            parts.append(part)
        return b"".join(parts)

    def upstream_headers(self, request: Request, request_id: str) -> dict[str, str]:
        headers = {"content-type": "application/json", self.config.request_id_header: request_id}
        session = request.headers.get(self._session_header)
        if session:
            headers[self.config.session_header] = session
        if self.config.upstream_api_key:
            headers["authorization"] = f"Bearer {self.config.upstream_api_key}"
        elif not self.config.api_keys and "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]  # transparent proxy
        return headers

    async def proxy(self, request: Request) -> ProxyResponse:
        arrival = time.monotonic()
        path = request.url.path
        try:
            self.check_auth(request)
            body = await self.read_body(request)
            parsed = await self.parse(path, body)
        except Exception as exc:
            err = to_chatfleet_error(exc)
            self.metrics.rejected(err.code or err.error_type)
            raise
        request_id = request.headers.get(self.config.request_id_header) or uuid.uuid4().hex
        call = ProxyCall(
            path=path, body=body, stream=parsed.stream,
            session=self.session_of(request, parsed),
            request_id=request_id, headers=self.upstream_headers(request, request_id),
            arrival=arrival,
        )
        return ProxyResponse(self, call)

    async def parse(self, path: str, body: bytes) -> ParsedBody:
        """Validate the body as the endpoint's OpenAI request, without touching a replica."""
        parsed = await self.bodies.inspect(path, body)
        if isinstance(parsed, BodyRejected):
            raise InvalidRequestError(parsed.message, param=parsed.param)
        known = {m["id"] for m in self.replicas.models()}
        if parsed.model is not None and known and parsed.model not in known:
            raise ModelNotFoundError(f"model {parsed.model!r} is not served here; available: {sorted(known)}",
                                     param="model")
        return parsed

    def session_of(self, request: Request, parsed: ParsedBody) -> SessionKey:
        """The session header wins over what the body says."""
        value = request.headers.get(self._session_header)
        return SessionKey(value, KeySource.HEADER) if value else parsed.session

    def status(self) -> dict[str, Any]:
        out = []
        processes = self.processes() if self.processes is not None else {}
        for url, replica in self.replicas.replicas.items():
            cap = self.admission.cap(url)
            out.append({
                "url": url, "healthy": replica.healthy, "cap": None if cap == float("inf") else cap,
                "in_flight": self.admission.in_flight(url), "queued": self.admission.queued(url),
                "consecutive_failures": replica.consecutive_failures, "last_error": replica.last_error,
                "models": [m["id"] for m in replica.models], "stats": vars(replica.stats).copy(),
            })
            if url in processes:
                out[-1]["process"] = asdict(processes[url])
        return {"replicas": out, "queued_total": self.admission.queued_total,
                "queued_new": self.admission.queued_new,
                "shed_new": sum(r.stats.shed_new for r in self.replicas.replicas.values()),
                "shed_returning": sum(r.stats.shed_returning for r in self.replicas.replicas.values()),
                "sessions_in_progress": len(self.sessions_seen),
                "routing_policy": self.config.routing_policy}
