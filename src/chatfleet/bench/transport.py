"""HTTP transports for the load generator: each yields body bytes with their arrival time.

``raw``: one keep-alive HTTP/1.1 connection per live chat over asyncio streams (the default:
it is what holds thousands of streams from one process, see benchmarks/loadgen_capacity.py).
``httpx``: an ``httpx.AsyncClient`` pool, for servers behind TLS or proxies.
Both report times from ``time.perf_counter_ns``.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_mod
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

from chatfleet.errors import ConfigError

if TYPE_CHECKING:
    import httpx


@dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str
    port: int
    base_path: str  # e.g. '' or '/v1' prefix given in the URL, without trailing slash

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError(f"server URL must look like http://127.0.0.1:8000, got {url!r}")
        port = u.port or (443 if u.scheme == "https" else 80)
        path = u.path.rstrip("/")
        if path.endswith("/v1"):
            path = path[: -len("/v1")]
        return cls(u.scheme, u.hostname, port, path)

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return self.origin + self.base_path + path


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    chunks: AsyncIterator[tuple[int, bytes]]  # (perf_counter_ns at arrival, bytes)


class Session(Protocol):
    """One live chat's connection(s)."""

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> Response: ...

    async def discard(self) -> None: ...


class Transport(Protocol):
    name: str

    def session(self) -> Session: ...

    async def close(self) -> None: ...


class ProtocolError(ConnectionError):
    """The server's HTTP response could not be parsed."""


class _ChunkedDecoder:
    """Incremental HTTP/1.1 chunked transfer decoding (trailers are skipped)."""

    def __init__(self) -> None:
        self.buf = b""
        self.done = False
        self._trailers = False

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        out = []
        while not self.done:
            if self._trailers:
                i = self.buf.find(b"\r\n")
                if i < 0:
                    break
                line, self.buf = self.buf[:i], self.buf[i + 2 :]
                self.done = not line
                continue
            i = self.buf.find(b"\r\n")
            if i < 0:
                break
            try:
                size = int(self.buf[:i].split(b";", 1)[0].strip() or b"0", 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size line {self.buf[:i][:40]!r}") from None
            if size == 0:
                self.buf = self.buf[i + 2 :]
                self._trailers = True
                continue
            end = i + 2 + size
            if len(self.buf) < end + 2:
                break
            out.append(self.buf[i + 2 : end])
            self.buf = self.buf[end + 2 :]
        return b"".join(out)


class RawSession:
    """One keep-alive HTTP/1.1 connection, reopened when the server or an error closes it."""

    def __init__(self, ep: Endpoint, extra_headers: dict[str, str]) -> None:
        self.ep = ep
        self.extra = extra_headers
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        ctx = ssl_mod.create_default_context() if self.ep.scheme == "https" else None
        reader, writer = await asyncio.open_connection(self.ep.host, self.ep.port, ssl=ctx, limit=1 << 20)
        self.reader, self.writer = reader, writer
        return reader, writer

    async def discard(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except (OSError, ConnectionError):
                pass
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> Response:
        reader, writer = self.reader, self.writer
        if reader is None or writer is None or writer.is_closing() or reader.at_eof():
            await self.discard()
            reader, writer = await self._connect()
        hdrs = {"Host": f"{self.ep.host}:{self.ep.port}", "Content-Type": "application/json",
                "Content-Length": str(len(body)), "Connection": "keep-alive", **self.extra, **headers}
        head = f"POST {self.ep.base_path}{path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
        writer.write(head.encode("latin-1") + b"\r\n" + body)
        try:
            raw_head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            await self.discard()
            raise ConnectionError(f"connection closed before a response: {e}") from e
        lines = raw_head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            await self.discard()
            raise ProtocolError(f"bad status line {lines[0]!r}")
        resp_headers = {}
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(":")
                resp_headers[k.strip().lower()] = v.strip()
        return Response(int(parts[1]), resp_headers, self._body(reader, resp_headers))

    async def _body(self, reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[tuple[int, bytes]]:
        keep = headers.get("connection", "").lower() != "close"
        clock = time.perf_counter_ns
        try:
            if "chunked" in headers.get("transfer-encoding", "").lower():
                # One read per arrival, however many chunks it holds: they arrived together.
                dec = _ChunkedDecoder()
                while not dec.done:
                    data = await reader.read(1 << 16)
                    if not data:
                        raise ConnectionError("connection closed inside a chunked body")
                    now = clock()
                    body = dec.feed(data)
                    if body:
                        yield now, body
                if dec.buf:
                    keep = False  # bytes after the body: not a response we asked for
            elif "content-length" in headers:
                n = int(headers["content-length"])
                if n:
                    yield clock(), await reader.readexactly(n)
            else:
                keep = False
                while data := await reader.read(65536):
                    yield clock(), data
        except BaseException:
            await self.discard()
            raise
        if not keep:
            await self.discard()


class RawTransport:
    name = "raw"

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.ep = Endpoint.parse(url)
        self.headers = headers or {}
        self._sessions: list[RawSession] = []

    def session(self) -> RawSession:
        s = RawSession(self.ep, self.headers)
        self._sessions.append(s)
        return s

    async def close(self) -> None:
        for s in self._sessions:
            await s.discard()
        self._sessions.clear()


class HttpxSession:
    def __init__(self, transport: HttpxTransport) -> None:
        self.t = transport
        self._resp: httpx.Response | None = None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> Response:
        client = self.t.client
        req = client.build_request("POST", self.t.ep.url(path), content=body,
                                   headers={"Content-Type": "application/json", **self.t.headers, **headers})
        import httpx

        try:
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as e:  # mapped to the errors the client records
            raise ConnectionError(f"{type(e).__name__}: {e}") from e
        self._resp = resp

        async def chunks() -> AsyncIterator[tuple[int, bytes]]:
            try:
                async for data in resp.aiter_raw():
                    yield time.perf_counter_ns(), data
            except httpx.HTTPError as e:
                raise ConnectionError(f"{type(e).__name__}: {e}") from e
            finally:
                await resp.aclose()

        return Response(resp.status_code, {k.lower(): v for k, v in resp.headers.items()}, chunks())

    async def discard(self) -> None:
        if self._resp is not None:
            await self._resp.aclose()
            self._resp = None


class HttpxTransport:
    name = "httpx"

    def __init__(self, url: str, headers: dict[str, str] | None = None, max_connections: int = 4096) -> None:
        import httpx

        self.ep = Endpoint.parse(url)
        self.headers = headers or {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=10.0))

    def session(self) -> HttpxSession:
        return HttpxSession(self)

    async def close(self) -> None:
        await self.client.aclose()


TRANSPORTS = {"raw": RawTransport, "httpx": HttpxTransport}


def make_transport(name: str, url: str, headers: dict[str, str] | None = None) -> Transport:
    if name not in TRANSPORTS:
        raise ConfigError(f"unknown transport {name!r}; valid: {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name](url, headers)
