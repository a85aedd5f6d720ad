"""One proxied request: route, admit, call the replica, pass the response through.

``ProxyResponse`` is an ASGI response that does all of it while listening for the client: a
client that leaves, while queued or while streaming, cancels the work, which closes the upstream
response (so the engine aborts the request and frees its KV blocks) and releases the slot.
Replica failures before the first byte reaches the client (connect errors, timeouts, a 5xx the
replica marks as its own, a stream that breaks before its first event; see ``faults.py``) and
busy replies (503) are retried on another replica; a reply about the request itself (4xx, or a
5xx the replica does not mark as its own) is passed on as it is; a stream that breaks later ends
with an SSE error event and a clean close. Every request ends with a reply or an explicit error.

A call runs against a ``ProxyContext``: the parts of the gateway it reads and updates
(``service.Gateway`` is one). The proxy knows those parts, not the gateway that owns them.

A large body (``read_pacing.LARGE_BODY_BYTES`` or more) goes to the replica in pieces of
``FORWARD_PIECE_BYTES`` that spend the same byte budget as the gateway's reads
(``paced_pieces``), with its length declared, so that a burst of large bodies reaches the
replica at the rate the gateway reads them. It was added against the gateway's stalls under
hostile bodies and measured no gain there (one 7.8 MB write costs ~0.05 ms on uvloop: the loop
keeps what the socket does not take); see benchmarks/README.md, hostile_bodies.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from chatfleet.errors import ChatfleetError, NoHealthyReplicaError, RateLimitError, UpstreamError
from chatfleet.gateway.admission import AdmissionController, Outcome, Priority
from chatfleet.gateway.config import GatewayConfig
from chatfleet.gateway.faults import Verdict, classify
from chatfleet.gateway.fleet_state import Conversations
from chatfleet.gateway.metrics import GatewayMetrics
from chatfleet.gateway.replicas import ReplicaSet
from chatfleet.gateway.routing import Affinity, RoutingDecision, RoutingPolicy
from chatfleet.gateway.session import SessionKey
from chatfleet.protocol.errors import error_event, error_response, to_chatfleet_error
from chatfleet.protocol.read_pacing import LARGE_BODY_BYTES, ReadPacer
from chatfleet.protocol.sse import DONE, EventFramer

log = logging.getLogger("chatfleet.gateway")

UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError)  # read timeouts raise TimeoutError subclasses
PASS_HEADERS = ("content-type", "content-encoding")
FORWARD_PIECE_BYTES = 256 << 10


async def paced_pieces(body: bytes, pacer: ReadPacer, piece: int = FORWARD_PIECE_BYTES) -> AsyncIterator[bytes]:
    """``body`` in pieces of ``piece`` bytes, each sent once ``pacer`` has budget for it."""
    for start in range(0, len(body), piece):
        part = body[start:start + piece]
        await pacer.take(len(part))
        yield part


class ProxyContext(Protocol):
    """The gateway parts one proxied call uses: replicas and their upstream clients, the router,
    admission, the conversations seen, metrics and the configuration."""

    config: GatewayConfig
    replicas: ReplicaSet
    router: RoutingPolicy
    admission: AdmissionController
    metrics: GatewayMetrics
    conversations: Conversations  # in progress: this gateway's memory, shared through Redis if set
    sessions: dict[str, aiohttp.ClientSession]  # one upstream client per replica URL
    pacer: ReadPacer  # the byte budget large bodies' reads and forwards spend


@dataclass(frozen=True)
class ProxyCall:
    """A validated client request, ready to be sent to some replica."""

    path: str
    body: bytes
    stream: bool
    session: SessionKey
    request_id: str
    headers: dict[str, str]  # headers for the upstream request
    arrival: float
    continues: bool = False  # the body carries earlier turns: returning, whatever any gateway remembers
    release: Callable[[], None] | None = None  # called once when the response ends (the tenant's slot)


@dataclass
class _Failure:
    error: str
    replica_fault: bool  # counts against the replica's health
    response: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None  # an HTTP reply to pass on


@dataclass
class _Started:
    response: aiohttp.ClientResponse
    chunks: Any  # the rest of the raw body
    first: bytes
    whole: bool  # ``first`` is the whole body


def _stale_connection(exc: BaseException) -> bool:
    """A kept-alive connection the replica closed (e.g. after answering an error) fails like this
    when reused, before any reply: not the replica's failure. A refused connection is."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return False
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class ProxyResponse:
    def __init__(self, gateway: ProxyContext, call: ProxyCall) -> None:
        self.gw = gateway
        self.call = call
        self.status = 0
        self.replica: str | None = None
        self.decision: RoutingDecision | None = None
        self.attempts = 0
        self.queue_wait = 0.0
        self.ttft: float | None = None
        self.outcome = "started"
        self.returning = False
        self.error: str | None = None  # what went wrong upstream, for the log

    # -- ASGI --------------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self._scope, self._receive = scope, receive
        self._started = False

        async def tracked_send(message: dict[str, Any]) -> None:
            self._started = True
            await send(message)

        work = asyncio.ensure_future(self._run_safely(tracked_send))
        listen = asyncio.ensure_future(self._listen(receive))
        try:
            done, _ = await asyncio.wait((work, listen), return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                self.outcome = "client_left"
                work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        finally:
            listen.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            if self.call.release is not None:
                self.call.release()
            self._log()

    @staticmethod
    async def _listen(receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    # -- the request's life ------------------------------------------------------------------
    async def _run_safely(self, send: Any) -> None:
        """``_run``, with any bug answered as an explicit error instead of a hang or a cut."""
        try:
            await self._run(send)
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            log.exception("proxy failed", extra={"request_id": self.call.request_id})
            self.outcome, self.error = "gateway_error", f"{type(exc).__name__}: {exc}"
            err = to_chatfleet_error(exc)
            if not isinstance(exc, ChatfleetError):  # details go to the log, not to the client
                err = ChatfleetError(f"the gateway failed on this request (request id {self.call.request_id})")
            if not self._started:
                await self._send_error(send, err)
            elif self.call.stream:
                await send({"type": "http.response.body", "body": error_event(err) + DONE,
                            "more_body": False})

    async def _run(self, send: Any) -> None:
        gw, call = self.gw, self.call
        returning = call.continues or await gw.conversations.is_returning(call.session.key)
        priority = Priority.RETURNING if returning else Priority.FIRST
        self.returning = returning
        deadline = call.arrival + gw.config.max_queue_wait_s
        tried: set[str] = set()
        last: _Failure | None = None
        while True:
            candidates = [url for url in gw.replicas.healthy() if url not in tried]
            if not candidates or self.attempts > gw.config.max_retries or self._past_total_timeout():
                return await self._give_up(send, last, tried)
            full = [url for url in candidates if gw.admission.is_full(url)]
            decision = gw.router.route(call.session.key, candidates, gw.admission.loads(), full)
            admission = await gw.admission.admit(decision.replica, priority, deadline)
            self.queue_wait += admission.waited_s
            if admission.outcome is Outcome.REROUTE:
                continue
            replica = gw.replicas[decision.replica]
            if admission.outcome is Outcome.SHED:
                replica.stats.shed += 1
                if returning:
                    replica.stats.shed_returning += 1
                else:
                    replica.stats.shed_new += 1
                self.replica, self.outcome = decision.replica, f"shed:{admission.reason}"
                gw.metrics.observe_queue_wait(decision.replica, admission.waited_s)
                return await self._send_error(send, RateLimitError(
                    self._shed_message(decision.replica, admission.reason),
                    retry_after_s=admission.retry_after_s))
            gw.metrics.observe_queue_wait(decision.replica, admission.waited_s)
            await gw.conversations.admitted(call.session.key)
            self.attempts += 1
            try:
                result = await self._attempt(decision.replica)
                if isinstance(result, _Failure):
                    last = result
                    tried.add(decision.replica)
                    if result.replica_fault:
                        gw.replicas.record_failure(decision.replica, result.error)
                    replica.stats.retried += 1
                    continue
                gw.replicas.record_success(decision.replica)
                self._count_affinity(decision)
                await self._respond(send, decision.replica, result)
            finally:
                gw.admission.release(decision.replica)
            return

    async def _attempt(self, url: str) -> _Failure | _Started:
        """Send to ``url``: a failure, or a response ready to pass on."""
        for last_try in (False, True):
            try:
                response = await self.gw.sessions[url].post(url + self.call.path, **self._body())
                break
            except UPSTREAM_ERRORS as exc:
                if not last_try and _stale_connection(exc):
                    continue  # a pooled connection the replica had already closed: once more, afresh
                return _Failure(_describe(exc), replica_fault=not self._past_total_timeout())
        whole = not (self.call.stream and response.status == 200
                     and response.content_type == "text/event-stream")
        chunks = response.content.iter_any()
        try:  # a stream is committed at its first chunk; anything else once read whole
            first = await response.read() if whole else await anext(chunks, b"")
        except UPSTREAM_ERRORS as exc:
            response.close()
            return _Failure(f"{url} broke before its first byte: {_describe(exc)}",
                            replica_fault=not self._past_total_timeout())
        except BaseException:  # the client left during prefill: the replica must see it now
            response.close()
            raise
        verdict = classify(response.status, first) if whole else Verdict.ANSWER
        if verdict is not Verdict.ANSWER:
            response.close()
            return _Failure(f"{url} answered {response.status}",
                            replica_fault=verdict is Verdict.FAILURE,
                            response=(response.status, self._headers_of(response), first))
        if response.status >= 500:  # about this request, says the replica: check it anyway
            self.gw.replicas.check_soon(url)
        if not whole and not first:
            response.close()
            return _Failure(f"{url} closed the stream before its first event", replica_fault=True)
        return _Started(response, chunks, first, whole)

    def _body(self) -> dict[str, Any]:
        """The upstream request's body and headers: a large body in paced pieces (a fresh
        iterator for each attempt), its length declared so that the replica reads it as sent."""
        body = self.call.body
        if len(body) < LARGE_BODY_BYTES:
            return {"data": body, "headers": self.call.headers}
        return {"data": paced_pieces(body, self.gw.pacer),
                "headers": {**self.call.headers, "content-length": str(len(body))}}

    async def _respond(self, send: Any, url: str, started: _Started) -> None:
        response, gw = started.response, self.gw
        self.replica, self.status = url, response.status
        stats = gw.replicas[url].stats
        stats.requests += 1
        headers = self._headers_of(response) + self._own_headers(url)
        try:
            if started.whole:
                headers.append((b"content-length", str(len(started.first)).encode()))
                await send({"type": "http.response.start", "status": self.status, "headers": headers})
                await send({"type": "http.response.body", "body": started.first, "more_body": False})
                self._first_byte(url)
                self.outcome = "ok" if self.outcome == "started" else self.outcome
                return
            await send({"type": "http.response.start", "status": self.status, "headers": headers})
            framer = EventFramer()
            error = ""
            try:
                out = framer.push(started.first)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                    self._first_byte(url)
                async for chunk in started.chunks:
                    out = framer.push(chunk)
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                        if self.ttft is None:
                            self._first_byte(url)
                if framer.tail:
                    error = "the replica's stream ended inside an event"
            except UPSTREAM_ERRORS as exc:
                error = _describe(exc)
            if error and self._past_total_timeout():  # our deadline, not the replica's fault
                self.outcome, self.error = "total_timeout", error
                late = UpstreamError(f"the reply took longer than the gateway's total timeout of "
                                     f"{gw.config.total_timeout_s:g} s; it is incomplete", code="timeout")
                await send({"type": "http.response.body", "body": error_event(late) + DONE,
                            "more_body": True})
            elif error:
                self.outcome = "stream_broken"
                stats.stream_breaks += 1
                gw.replicas.record_failure(url, error)
                self.error = error
                broken = UpstreamError("the replica failed mid-stream; the reply is incomplete")
                await send({"type": "http.response.body", "body": error_event(broken) + DONE,
                            "more_body": True})
            elif self.outcome == "started":
                self.outcome = "ok"
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            response.close()  # a no-op once read to the end; else the replica sees the client leave
            gw.metrics.observe_latency(url, time.monotonic() - self.call.arrival)

    def _past_total_timeout(self) -> bool:
        total = self.gw.config.total_timeout_s
        return total is not None and time.monotonic() - self.call.arrival >= total * 0.99

    def _first_byte(self, url: str) -> None:
        self.ttft = time.monotonic() - self.call.arrival
        self.gw.metrics.observe_ttft(url, self.ttft)

    async def _give_up(self, send: Any, last: _Failure | None, tried: set[str]) -> None:
        if last is not None and last.response is not None:
            status, headers, body = last.response
            self.status, self.outcome = status, "upstream_error"
            await send({"type": "http.response.start", "status": status,
                        "headers": headers + self._own_headers(None)})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        if last is not None:
            self.outcome = "upstream_error"
            self.error = last.error  # to the log, with the request id; never to the client
            exc: ChatfleetError = UpstreamError(
                f"no replica could serve the request ({len(tried)} tried); retry later")
        else:
            self.outcome = "no_healthy_replica"
            exc = NoHealthyReplicaError("no healthy replica is available; retry later")
        await self._send_error(send, exc)

    async def _send_error(self, send: Any, exc: ChatfleetError) -> None:
        response = error_response(exc)
        response.headers[self.gw.config.request_id_header] = self.call.request_id
        self.status = response.status_code
        await response(self._scope, self._receive, send)

    # -- helpers -----------------------------------------------------------------------------
    def _count_affinity(self, decision: RoutingDecision) -> None:
        self.decision = decision
        if decision.affinity is Affinity.KEPT:
            self.gw.replicas[decision.replica].stats.affinity_kept += 1
        elif decision.affinity is Affinity.BROKEN and decision.home is not None:
            home = self.gw.replicas.replicas.get(decision.home)  # None: drained and forgotten meanwhile
            if home is not None:
                home.stats.affinity_broken += 1

    def _shed_message(self, url: str, reason: str) -> str:
        cap = self.gw.admission.cap(url)
        if reason == "queue_full":
            why = f"the queue is full ({self.gw.config.queue_size} waiting)"
        elif reason == "new_queue_full":
            why = (f"{self.gw.admission.max_queued_new} new conversations already wait "
                   "(conversations in progress go first)")
        elif reason == "displaced":
            why = "a returning conversation took its place in the queue"
        else:
            why = f"no slot freed within {self.gw.config.max_queue_wait_s:g} s"
        return f"over capacity: the replica for this request holds its cap of {cap:g} requests and {why}; retry later"

    @staticmethod
    def _headers_of(response: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
        return [(k.lower(), v) for k, v in response.raw_headers if k.lower().decode() in PASS_HEADERS]

    def _own_headers(self, url: str | None) -> list[tuple[bytes, bytes]]:
        cfg = self.gw.config
        out = [(cfg.request_id_header.lower().encode(), self.call.request_id.encode())]
        if url is not None:
            out.append((cfg.replica_header.lower().encode(), url.encode()))
        return out

    def _log(self) -> None:
        if not self.gw.config.log_requests:
            return
        now = time.monotonic()
        decision = self.decision
        log.info("request", extra={
            "request_id": self.call.request_id, "path": self.call.path, "stream": self.call.stream,
            "status": self.status, "outcome": self.outcome, "replica": self.replica,
            "attempts": self.attempts, "session_source": self.call.session.source.value,
            "returning": self.returning,
            "affinity": decision.affinity.value if decision else None,
            "queue_wait_ms": round(self.queue_wait * 1e3, 3),
            "ttft_ms": None if self.ttft is None else round(self.ttft * 1e3, 3),
            "duration_ms": round((now - self.call.arrival) * 1e3, 3), "error": self.error,
        })
