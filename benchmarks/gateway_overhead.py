"""What the gateway adds: TTFT and per-chunk latency, direct to a replica vs through the gateway.

One run, side by side: a fast fake replica (``chatfleet.testing.fake_server``, stamping each
chunk with its send time) and a ``chatfleet gateway`` in front of it, each in its own process.
At each concurrency level, closed-loop streams hit the replica directly and then through the
gateway, alternating ``--reps`` times, so both see the same machine. A lean raw-HTTP client
measures TTFT (request sent -> first token event) and per-chunk latency (replica send time ->
client receive time). Then ``--hold`` streams are opened through the gateway at once and held
(one chunk per ``--hold-interval`` seconds) to check that all of them complete without errors.

    python benchmarks/gateway_overhead.py                      # levels 1, 100, 1000; hold 2200
    python benchmarks/gateway_overhead.py --levels 1,100 --hold 0 --duration 3

Prints a table and writes JSON (default benchmarks/results/gateway_overhead.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from chatfleet.loopback import free_port
from chatfleet.protocol.sse import DataSplitter

HERE = Path(__file__).resolve().parent
# `chatfleet gateway --replica URL --port N --queue-size 10000`, without the other CLI groups
GATEWAY = ("from chatfleet.gateway.app import run_gateway; from chatfleet.gateway.config import GatewayConfig; "
           "run_gateway(GatewayConfig(replicas=('{replica_url}',), port={port}, queue_size=10000))")


# ---------------------------------------------------------------------------------- client
@dataclass
class Sample:
    ttft: list[float] = field(default_factory=list)
    chunk: list[float] = field(default_factory=list)
    requests: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


class Conn:
    """One keep-alive HTTP/1.1 connection speaking just enough to stream a chat completion."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def stream(self, body: bytes, sample: Sample, on_first=None) -> None:
        if self.writer is None:
            await self.open()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        t0 = time.perf_counter()
        self.writer.write(head + body)
        reader = self.reader
        status_head = await reader.readuntil(b"\r\n\r\n")
        status = int(status_head.split(b" ", 2)[1])
        if status != 200 or b"chunked" not in status_head.lower():
            length = 0
            for line in status_head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            sample.error(f"http_{status}")
            return
        sse, first, done = DataSplitter(), True, False
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            data = (await reader.readexactly(size + 2))[:-2]
            now_ns, now_pc = time.perf_counter_ns(), time.perf_counter()
            for ev in sse.feed(data):
                at = ev.find(b'"x_sent_ns":')
                if at >= 0:
                    sample.chunk.append((now_ns - int(ev[at + 12:ev.index(b"}", at)])) * 1e-9)
                    if first:
                        sample.ttft.append(now_pc - t0)
                        first = False
                        if on_first is not None:
                            on_first()
                elif ev == b"[DONE]":
                    done = True
                elif b'"error"' in ev:
                    sample.error("error_event")
        sample.requests += 1
        if not done:
            sample.error("no_done")


async def closed_loop(host: str, port: int, streams: int, duration: float, tokens: int,
                      interval: float, seed: int = 0) -> Sample:
    """``streams`` workers sending requests back to back for ``duration`` seconds.

    Workers start spread over one stream's length and draw each reply's length from
    [tokens/2, 3*tokens/2], so arrivals are spread out as in real traffic instead of coming in
    lockstep bursts. Requests started during the first stream length (ramp-up) are not counted.
    """
    rng = random.Random(seed)
    stream_s = tokens * interval
    measured, ramp = Sample(), Sample()
    start = time.perf_counter()
    deadline = start + stream_s + duration

    async def worker(offset: float) -> None:
        await asyncio.sleep(offset)
        conn = Conn(host, port)
        try:
            while time.perf_counter() < deadline:
                sample = measured if time.perf_counter() - start >= stream_s else ramp
                n = rng.randint(max(1, tokens // 2), max(1, 3 * tokens // 2))
                try:
                    await conn.stream(body_for(n), sample)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    sample.error(type(exc).__name__)
                    conn.close()
                    await asyncio.sleep(0.01)
        finally:
            conn.close()

    await asyncio.gather(*(worker(rng.uniform(0, stream_s)) for _ in range(streams)))
    measured.errors += ramp.errors
    for kind, n in ramp.error_kinds.items():
        measured.error_kinds[kind] = measured.error_kinds.get(kind, 0) + n
    return measured


async def back_to_back(host: str, port: int, requests: int) -> Sample:
    """One connection, one-token replies, one request after another: the per-request cost."""
    sample, conn = Sample(), Conn(host, port)
    try:
        for _ in range(requests):
            await conn.stream(body_for(1), sample)
    finally:
        conn.close()
    return sample


def body_for(tokens: int, **extra) -> bytes:
    return json.dumps({"model": "fake", "stream": True, "max_tokens": tokens, **extra,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()


async def hold(host: str, port: int, streams: int, body: bytes, gateway_url: str) -> dict:
    """Open ``streams`` streams within a second; count how many are live together, and failures."""
    sample, live, peak, gw_peak = Sample(), [0], [0], [0]

    async def one(i: int) -> None:
        await asyncio.sleep(i / streams)
        began = [False]

        def started() -> None:
            began[0] = True
            live[0] += 1
            peak[0] = max(peak[0], live[0])

        conn = Conn(host, port)
        try:
            await conn.stream(body, sample, on_first=started)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            sample.error(type(exc).__name__)
        finally:
            conn.close()
            live[0] -= began[0]

    async def watch() -> None:
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
            while True:
                await asyncio.sleep(1.0)
                try:
                    status = (await client.get(gateway_url + "/gateway/status")).json()
                except httpx.HTTPError:
                    continue  # a busy gateway may answer late; the next look counts
                gw_peak[0] = max(gw_peak[0], sum(r["in_flight"] for r in status["replicas"]))

    watcher = asyncio.ensure_future(watch())
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(streams)))
    watcher.cancel()
    return {"streams": streams, "completed": sample.requests - sample.error_kinds.get("no_done", 0),
            "errors": sample.errors, "error_kinds": sample.error_kinds, "peak_live_streams": peak[0],
            "peak_gateway_in_flight": gw_peak[0], "seconds": round(time.perf_counter() - t0, 2),
            "ttft_ms": summary(sample.ttft)}


# ----------------------------------------------------------------------------- processes


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} not healthy after {timeout} s")


def summary(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    a = np.asarray(values) * 1e3
    return {"n": len(values), "p50": round(float(np.percentile(a, 50)), 3),
            "p90": round(float(np.percentile(a, 90)), 3), "p99": round(float(np.percentile(a, 99)), 3),
            "mean": round(float(a.mean()), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,100,1000", help="concurrent streams per level")
    parser.add_argument("--duration", type=float, default=6.0, help="measured seconds per phase")
    parser.add_argument("--reps", type=int, default=2, help="direct/gateway alternations per level")
    parser.add_argument("--tokens", type=int, default=16, help="mean chunks per stream")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between chunks")
    parser.add_argument("--probe", type=int, default=300, help="back-to-back one-token requests per mode and rep")
    parser.add_argument("--hold", type=int, default=2200, help="streams held at once (0: skip)")
    parser.add_argument("--hold-tokens", type=int, default=20)
    parser.add_argument("--hold-interval", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gateway_overhead.json")
    args = parser.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children inherit it
    replica_port, gateway_port = free_port(), free_port()
    replica_url = f"http://127.0.0.1:{replica_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = open(args.out.with_suffix(".gateway.log"), "w")  # the gateway's JSON request log
    procs = [
        subprocess.Popen([sys.executable, "-m", "chatfleet.testing.fake_server", "--port", str(replica_port),
                          "--tokens", str(args.tokens), "--ttft-ms", "0", "--itl-ms", str(args.interval * 1e3)],
                         env=env, stdout=subprocess.DEVNULL),
        subprocess.Popen([sys.executable, "-c", GATEWAY.format(replica_url=replica_url, port=gateway_port)],
                         env=env, stdout=log, stderr=log),
    ]
    try:
        wait_healthy(replica_url, procs[0])
        wait_healthy(gateway_url, procs[1])
        probe = None
        if args.probe:
            pooled = {"direct": [], "gateway": []}
            for _ in range(args.reps):
                for mode, port in (("direct", replica_port), ("gateway", gateway_port)):
                    s = asyncio.run(back_to_back("127.0.0.1", port, args.probe))
                    pooled[mode] += s.ttft[10:]  # the first few warm up the connection
            probe = {mode: summary(v) for mode, v in pooled.items()}
            probe["added_ms"] = {q: round(probe["gateway"][q] - probe["direct"][q], 3) for q in ("p50", "p99")}
            print(f"one stream, back-to-back one-token requests: TTFT p50/p99 direct "
                  f"{probe['direct']['p50']}/{probe['direct']['p99']} ms, gateway "
                  f"{probe['gateway']['p50']}/{probe['gateway']['p99']} ms, added "
                  f"{probe['added_ms']['p50']}/{probe['added_ms']['p99']} ms", flush=True)
        levels = []
        for streams in [int(x) for x in args.levels.split(",") if x]:
            pooled = {"direct": Sample(), "gateway": Sample()}
            for _ in range(args.reps):
                for mode, port in (("direct", replica_port), ("gateway", gateway_port)):
                    s = asyncio.run(closed_loop("127.0.0.1", port, streams, args.duration,
                                                args.tokens, args.interval))
                    p = pooled[mode]
                    p.ttft += s.ttft
                    p.chunk += s.chunk
                    p.requests += s.requests
                    for kind, n in s.error_kinds.items():
                        for _ in range(n):
                            p.error(kind)
            row = {"streams": streams}
            for mode, s in pooled.items():
                row[mode] = {"requests": s.requests, "errors": s.errors, "error_kinds": s.error_kinds,
                             "chunks_per_s": round(len(s.chunk) / (args.duration * args.reps)),
                             "ttft_ms": summary(s.ttft), "chunk_ms": summary(s.chunk)}
            row["added_ms"] = {
                f"{what}_{q}": round(row["gateway"][f"{what}_ms"].get(q, float("nan"))
                                     - row["direct"][f"{what}_ms"].get(q, float("nan")), 3)
                for what in ("ttft", "chunk") for q in ("p50", "p99")}
            if not levels:
                print_header()
            levels.append(row)
            print_row(row)
        held = None
        if args.hold:
            held = asyncio.run(hold("127.0.0.1", gateway_port, args.hold, body_for(
                args.hold_tokens, fake_interval_s=args.hold_interval), gateway_url))
            print(f"hold: {held['streams']} streams through the gateway, {held['completed']} completed, "
                  f"{held['errors']} errors {held['error_kinds'] or ''}, peak live {held['peak_live_streams']}, "
                  f"peak gateway in-flight {held['peak_gateway_in_flight']}, {held['seconds']} s, "
                  f"TTFT p99 {held['ttft_ms'].get('p99')} ms")
        result = {"benchmark": "gateway_overhead", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                  "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
                  "settings": {k: str(v) for k, v in vars(args).items()}, "probe": probe, "levels": levels,
                  "hold": held}
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


def print_header() -> None:
    print(f"{'streams':>8} {'mode':>8} {'reqs':>7} {'errs':>5} {'chunk/s':>8} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'chunk p50':>10} {'chunk p99':>10}  (ms)", flush=True)


def print_row(row: dict) -> None:
    for mode in ("direct", "gateway"):
        m = row[mode]
        print(f"{row['streams']:>8} {mode:>8} {m['requests']:>7} {m['errors']:>5} {m['chunks_per_s']:>8} "
              f"{m['ttft_ms'].get('p50', '-'):>9} {m['ttft_ms'].get('p99', '-'):>9} "
              f"{m['chunk_ms'].get('p50', '-'):>10} {m['chunk_ms'].get('p99', '-'):>10}")
    a = row["added_ms"]
    print(f"{'':>8} {'added':>8} {'':>7} {'':>5} {'':>8} {a['ttft_p50']:>9} {a['ttft_p99']:>9} "
          f"{a['chunk_p50']:>10} {a['chunk_p99']:>10}", flush=True)


if __name__ == "__main__":
    main()
