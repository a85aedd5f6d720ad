"""The gateway's state: replicas, router, admission, metrics and upstream clients, and the
request handling that turns an HTTP request into a ``ProxyResponse``. ``app.py`` wires it into
FastAPI; ``proxy.py`` runs each proxied call against it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
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
from chatfleet.gateway.discovery import DiscoveredReplicas, Discovery, describe, discovery_for
from chatfleet.gateway.fleet_state import Conversations
from chatfleet.gateway.metrics import GatewayMetrics
from chatfleet.gateway.proxy import ProxyCall, ProxyResponse
from chatfleet.gateway.replicas import ReplicaSet
from chatfleet.gateway.routing import RoutingPolicy, make_routing_policy
from chatfleet.gateway.session import KeySource, SessionKey
from chatfleet.gateway.session_tracker import SessionTracker
from chatfleet.gateway.tenants import (
    OPEN_TENANT,
    Tenant,
    TenantLimits,
    estimated_tokens,
    tenant_of_key,
    with_cache_salt,
)
from chatfleet.protocol.body_spool import BodyAssembler, SharedBody, finished
from chatfleet.protocol.errors import to_chatfleet_error
from chatfleet.protocol.read_pacing import LARGE_BODY_BYTES, ReadPacer
from chatfleet.protocol.safe_json import check_json_content_type

if TYPE_CHECKING:
    from chatfleet.gateway.supervisor import ProcessState

__all__ = ["ENDPOINTS", "Gateway"]

log = logging.getLogger("chatfleet.gateway")


class Gateway:
    """Everything one gateway process holds: replicas, router, admission, metrics, clients."""

    def __init__(self, config: GatewayConfig,
                 processes: Callable[[], Mapping[str, ProcessState]] | None = None,
                 discovery: Discovery | None = None) -> None:
        if not config.replicas and config.replicas_from is None and discovery is None:
            raise ConfigError("the gateway needs at least one replica (--replica URL or --replicas-from)")
        self.config = config
        self.processes = processes  # replica processes `serve` supervises, for the status
        self.discovery = discovery if discovery is not None else (
            discovery_for(config.replicas_from) if config.replicas_from is not None else None)
        self.discovered: DiscoveredReplicas | None = None  # the last set discovery reported
        urls = [spec.url for spec in config.replicas]
        self.admission = AdmissionController(
            {spec.url: config.cap_of(spec) for spec in config.replicas},
            queue_size=config.queue_size, max_wait_s=config.max_queue_wait_s,
            retry_after_s=config.retry_after_s, max_queued_new=config.new_queue_limit,
            on_idle=self._forget_if_drained,
        )
        self.sessions_seen = SessionTracker(config.session_ttl_s, config.max_sessions)
        self.conversations = Conversations(self.sessions_seen, config.state)
        self._tenants = {key: tenant_of_key(key, salt_per_key=config.salt_per_key)
                         for key in config.api_keys + config.admin_api_keys}
        self.limits = TenantLimits(config.key_max_in_flight, config.key_tokens_per_minute)
        self.bodies = BodyInspector(config.body_offload_bytes)
        self.pacer = ReadPacer()
        upstream_headers = {}
        if config.upstream_api_key:
            upstream_headers["authorization"] = f"Bearer {config.upstream_api_key}"
        self.replicas = ReplicaSet(
            urls, failure_threshold=config.failure_threshold,
            health_interval_s=config.health_interval_s, health_timeout_s=config.health_timeout_s,
            headers=upstream_headers, on_down=self.admission.drain,
        )
        self.router = self._ring(urls)
        self.metrics = GatewayMetrics(self.replicas, self.admission)
        self.sessions: dict[str, aiohttp.ClientSession] = {}
        self._session_header = config.session_header.lower()
        self._discovering: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def _ring(self, urls: Iterable[str]) -> RoutingPolicy:
        """The router over a replica set: a pure function of the set (sorted, so order is moot)."""
        return make_routing_policy(self.config.routing_policy, sorted(set(urls)),
                                   virtual_nodes=self.config.virtual_nodes, load_factor=self.config.load_factor)

    async def start(self) -> None:
        """Open one upstream connection pool per replica (aiohttp: it stays fast with thousands
        of open streams, where httpx's pool slows down), then start health checks and discovery."""
        for url in self.replicas.urls:
            self._open_session(url)
        await self.replicas.start()
        if self.discovery is not None:
            self._discovering = asyncio.create_task(self._follow_discovery(self.discovery),
                                                    name="chatfleet-discovery")

    def _open_session(self, url: str) -> None:
        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=cfg.total_timeout_s, connect=cfg.pool_timeout_s,
                                        sock_connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s)
        connector = aiohttp.TCPConnector(limit=cfg.max_connections_per_replica, limit_per_host=0,
                                         keepalive_timeout=4.0)  # < uvicorn's 5 s
        self.sessions[url] = aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, trust_env=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"))

    async def stop(self) -> None:
        if self._discovering is not None:
            self._discovering.cancel()
            await asyncio.gather(self._discovering, return_exceptions=True)
            self._discovering = None
        await self.replicas.stop()
        for session in self.sessions.values():
            await session.close()
        self.sessions.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
        await self.conversations.close()
        self.bodies.close()

    # -- membership (discovery) --------------------------------------------------------------
    async def _follow_discovery(self, discovery: Discovery) -> None:
        while True:
            try:
                async for found in discovery.changes():
                    await self.apply(found)
                return
            except Exception:  # a bug in a source must not freeze the fleet: log, start again
                log.exception("replica discovery failed; restarting it")
                await asyncio.sleep(self.config.health_interval_s)

    def members(self, found: DiscoveredReplicas | None) -> list[str]:
        """The replica set: the configured replicas plus the discovered ones."""
        static = [spec.url for spec in self.config.replicas]
        return sorted(set(static) | set(found.urls if found is not None else ()))

    async def apply(self, found: DiscoveredReplicas) -> None:
        """A new discovered set: new replicas join (routable once healthy), the ring is rebuilt
        from the set, removed ones drain (in-flight requests finish, nothing new goes there)
        and are forgotten once idle."""
        log.info("replica set changed", extra={"change": describe(found, self.members(self.discovered)),
                                                "source": found.source})
        self.discovered = found
        members = self.members(found)
        joined = []
        for url in members:
            if self.replicas.join(url):
                self.admission.add(url, self.config.cap_of(self.config.spec_of(url)))
                self._open_session(url)
                joined.append(url)
        for url in self.replicas.urls:
            if url not in members:
                self.replicas.drain(url)
                self._forget_if_drained(url)
        self.router = self._ring(members)
        if self.replicas.started:
            await asyncio.gather(*(self.replicas.check(url) for url in joined if url in self.replicas.replicas))

    def _forget_if_drained(self, url: str) -> None:
        replica = self.replicas.replicas.get(url)
        if replica is None or not replica.draining or not self.admission.is_idle(url):
            return
        self.replicas.forget(url)
        self.admission.remove(url)
        session = self.sessions.pop(url, None)
        if session is not None:
            task = asyncio.get_running_loop().create_task(session.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        log.info("replica forgotten (drained)", extra={"replica": url})

    # -- request handling --------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        self.authenticate(request)

    def authenticate(self, request: Request) -> Tenant:
        """The tenant of a key of ``api_keys`` (or of ``admin_api_keys``: an admin is a tenant
        too, so one key runs a sweep and its resets); the open tenant when no key is set."""
        if not self.config.api_keys:
            return OPEN_TENANT
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        if scheme.lower() == "bearer":
            for key, tenant in self._tenants.items():
                if hmac.compare_digest(given, key.encode()):
                    return tenant
        raise AuthenticationError("missing or invalid API key; send 'Authorization: Bearer <key>'")

    def check_admin(self, request: Request) -> None:
        """Admin routes: a key of ``admin_api_keys``; open only on a gateway with no keys at all."""
        if not self.config.admin_api_keys:
            if self.config.api_keys:
                raise AuthenticationError("admin routes need an admin key; start the gateway with --admin-key")
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(
            hmac.compare_digest(token.strip().encode(), key.encode()) for key in self.config.admin_api_keys
        ):
            raise AuthenticationError("missing or invalid admin key; send 'Authorization: Bearer <admin key>'")

    async def read_body(self, request: Request) -> bytes:
        """The request's body: over the limit a 413, and one not sent as JSON a 400 naming its
        content type (after the size, as the engine checks them)."""
        parts = await self.receive_body(request)
        try:
            return await finished(parts)
        finally:
            parts.close()

    async def receive_body(self, request: Request) -> BodyAssembler:
        """The request's body, all of it received, checked as ``read_body`` checks it, in an
        assembler the caller finishes and closes (a spooled body can be shared with the worker
        that inspects it, ``body_spool.SharedBody``)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(f"request body of {declared} bytes exceeds the limit of {limit}")
        parts = BodyAssembler()  # large bodies assembled off the GIL (body_spool.py)
        async for part in request.stream():
            if parts.size + len(part) > limit:
                parts.discard()
                raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
            parts.add(part)
            if max(parts.size, int(declared) if declared and declared.isdigit() else 0) >= LARGE_BODY_BYTES:
                await self.pacer.take(len(part))  # large bodies read at a bounded rate (read_pacing.py)
        if parts.size:
            try:
                check_json_content_type(request.headers.get("content-type"))
            except Exception:
                parts.discard()
                raise
        return parts

    def upstream_headers(self, request: Request, request_id: str, tenant: Tenant = OPEN_TENANT) -> dict[str, str]:
        headers = {"content-type": "application/json", self.config.request_id_header: request_id}
        session = tenant.scope(request.headers.get(self._session_header) or None)
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
            tenant = self.authenticate(request)
            parts = await self.receive_body(request)
            try:
                body = await finished(parts)
                parsed = await self.parse(path, body, parts.shared())
            finally:
                parts.close()  # the worker has read a shared body by now
            release = self.limits.admit(tenant, estimated_tokens(parsed.prompt_bytes, parsed.max_tokens))
        except Exception as exc:
            err = to_chatfleet_error(exc)
            self.metrics.rejected(err.code or err.error_type)
            raise
        salt = tenant.salt(parsed.cache_salt)
        if tenant.cache_salt is not None and salt is not None:
            body = with_cache_salt(body, salt)
        request_id = request.headers.get(self.config.request_id_header) or uuid.uuid4().hex
        session = self.session_of(request, parsed)
        call = ProxyCall(
            path=path, body=body, stream=parsed.stream,
            session=SessionKey(tenant.scope(session.key), session.source),
            request_id=request_id, headers=self.upstream_headers(request, request_id, tenant),
            arrival=arrival, continues=parsed.continues, release=release,
        )
        return ProxyResponse(self, call)

    async def parse(self, path: str, body: bytes, shared: SharedBody | None = None) -> ParsedBody:
        """Validate the body as the endpoint's OpenAI request, without touching a replica (a
        large one in the inspecting worker, which reads ``shared``, if given, for itself)."""
        parsed = await self.bodies.inspect(path, body, shared)
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
                "draining": replica.draining, "consecutive_failures": replica.consecutive_failures,
                "last_error": replica.last_error,
                "models": [m["id"] for m in replica.models], "stats": vars(replica.stats).copy(),
            })
            if url in processes:
                out[-1]["process"] = asdict(processes[url])
        return {"replicas": out, "queued_total": self.admission.queued_total,
                "queued_new": self.admission.queued_new,
                "shed_new": sum(r.stats.shed_new for r in self.replicas.replicas.values()),
                "shed_returning": sum(r.stats.shed_returning for r in self.replicas.replicas.values()),
                "sessions_in_progress": len(self.sessions_seen), "shared_state": self.conversations.shared,
                "gateways": self.config.gateways,
                "routing_policy": self.config.routing_policy,
                "replicas_from": self.config.replicas_from,
                "discovered": list(self.discovered.urls) if self.discovered is not None else None}
