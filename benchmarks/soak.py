"""Soak: twice the fleet's knee for a long while, a replica killed halfway, a disconnect storm.

The knee is measured first (unless --knee-from or --knee/--cap give it): `chatfleet sweep` in
closed loop, with this script's workload profile and SLO, through an uncapped gateway over the
two engines the soak then runs (the same processes on the same cores; --knee-through engine:
one engine alone). The knee is in live chats; the gateway counts requests in flight (a chat that
pauses holds none), so each engine's cap is its share of the requests in flight at the knee
(Little's law, ``chatfleet.gateway.knee``). `chatfleet serve` then runs the two engines behind a
gateway capped there; returning turns may wait for a slot at most --queue-share of the TTFT
target (the wait counts in their TTFT), new conversations over the caps are refused at once.
Closed-loop chats, `--load-factor` times the fleet's knee (2 x by default), talk through the
gateway for --duration seconds: the profile's conversations (the sweep's: card, turns, forced
reply lengths, think times) with their own session ids, streamed; a refused turn (429/503) waits
its Retry-After and tries again. Halfway, one engine is killed with SIGKILL and `serve` starts it
again; at --storm-at, --storm-size extra clients open streams and hang up after their first
chunk or at random. Every request ends in exactly one outcome: ok (a complete reply), refused
(429/503, with how long the refusal took), error (an explicit error: an error status or an SSE
error event), cancelled (the storm hung up), or lost (no reply and no explicit error: the number
that must be zero). The RSS of the gateway and of each engine is sampled throughout; the table
gives each process's slope after warm-up in MB/min.

    python benchmarks/soak.py                                  # knee, then 10 minutes
    python benchmarks/soak.py --duration 60 --knee 8 --cap 3   # a quick check

Prints a table and writes JSON (default benchmarks/results/soak.json; logs beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import httpx

from chatfleet.bench.slo import SLO, parse_slo, stat_of
from chatfleet.bench.tokens import load_counter
from chatfleet.bench.workload import Workload, get_profile
from chatfleet.gateway.knee import KneeCap, knee_cap
from chatfleet.loopback import free_port
from chatfleet.protocol.sse import DataSplitter

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import ServerProcess, load_average, percentile  # noqa: E402  (benchmarks/ on sys.path first)

CLI = [sys.executable, "-m", "chatfleet.cli.main"]


@dataclass
class Outcome:
    kind: str  # ok, refused, error, cancelled, lost
    status: int | None
    sent: float  # seconds since the soak started
    elapsed_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    detail: str | None = None
    returning: bool = False
    storm: bool = False  # a storm client's request (counted apart)


@dataclass
class Soak:
    url: str
    model: str
    workload: Workload
    conversations: Iterator[int] = field(default_factory=itertools.count)
    t0: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    stop: bool = False
    sessions: set[str] = field(default_factory=set)  # conversations in progress

    def now(self) -> float:
        return time.monotonic() - self.t0


async def one_turn(soak: Soak, http: aiohttp.ClientSession, session: str, messages: list[dict], max_tokens: int,
                   returning: bool, hang_up_after_s: float | None = None) -> tuple[Outcome, str, float]:
    """One streamed request (its reply forced to ``max_tokens``, as the sweep's); returns its
    outcome, the reply text and the Retry-After (s)."""
    body = {"model": soak.model, "messages": messages, "stream": True, "max_tokens": max_tokens,
            "min_tokens": max_tokens}
    sent, start = soak.now(), time.monotonic()
    text, ttft, last, itl, status = [], None, None, [], None

    def done(kind: str, detail: str | None = None) -> Outcome:
        return Outcome(kind, status, sent, time.monotonic() - start, ttft, itl, detail, returning)

    try:
        async with http.post(soak.url + "/v1/chat/completions", json=body,
                             headers={"X-Session-ID": session}) as resp:
            status = resp.status
            if status in (429, 503):
                await resp.read()
                return done("refused"), "", float(resp.headers.get("retry-after", "1"))
            if status != 200:
                return done("error", (await resp.text())[:200]), "", 0.0
            splitter = DataSplitter()
            async for chunk in resp.content.iter_any():
                for data in splitter.feed(chunk):
                    if data == b"[DONE]":
                        return done("ok"), "".join(text), 0.0
                    event = json.loads(data)
                    if "error" in event:
                        return done("error", str(event["error"].get("message"))[:200]), "", 0.0
                    for choice in event.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            now = time.monotonic()
                            if ttft is None:
                                ttft = now - start
                            else:
                                itl.append(now - last)
                            last = now
                            text.append(piece)
                if hang_up_after_s is not None and ttft is not None and time.monotonic() - start >= hang_up_after_s:
                    return done("cancelled"), "", 0.0
            return done("lost", "the stream ended without [DONE] or an error event"), "", 0.0
    except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
        return done("lost", f"{type(exc).__name__}: {exc}"[:200]), "", 0.0


async def chat_user(soak: Soak, http: aiohttp.ClientSession, rng: random.Random) -> None:
    """One live chat after another, as the sweep's closed loop drives them: the workload
    profile's conversations (card, turns, forced reply lengths, think times); a refused turn
    waits its Retry-After and is tried again; a chat that ends is followed by a new user after
    a think time."""
    while not soak.stop:
        conv = soak.workload.conversation(next(soak.conversations))
        session = uuid.uuid4().hex
        replies: list[str] = []
        turn = 0
        soak.sessions.add(session)
        while turn < len(conv.turns) and not soak.stop:
            messages = conv.messages(turn, replies)
            max_tokens = conv.turns[turn].reply_tokens
            outcome, reply, retry_after = await one_turn(soak, http, session, messages, max_tokens,
                                                         returning=turn > 0)
            soak.outcomes.append(outcome)
            if outcome.kind == "refused":
                await asyncio.sleep(retry_after * (0.5 + rng.random()))
                continue
            if outcome.kind != "ok":
                break  # an error or a lost reply ends this chat; a new one starts
            replies.append(reply)
            turn += 1
            if turn < len(conv.turns):
                await asyncio.sleep(conv.turns[turn].think_time_s)
        soak.sessions.discard(session)
        await asyncio.sleep(soak.workload.first_think_time(conv.conv_id))


async def storm(soak: Soak, size: int, rng: random.Random) -> None:
    """``size`` extra clients open streams at once and hang up early: half as new conversations
    (refused at once above the caps), half as extra turns of conversations in progress (which
    wait for or take a slot, then leave: the slot must come back)."""
    in_progress = sorted(soak.sessions)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        async def one(i: int) -> None:
            messages = [{"role": "user", "content": f"storm {i}: a long story please"}]
            hang = rng.uniform(0.0, 0.5)
            returning = bool(i % 2 and in_progress)
            session = rng.choice(in_progress) if returning else f"storm-{i}"
            task = asyncio.ensure_future(one_turn(soak, http, session, messages, 64, returning, hang))
            done, _ = await asyncio.wait({task}, timeout=hang + 0.05)
            if not done:  # no first chunk yet: hang up now
                task.cancel()
                soak.outcomes.append(Outcome("cancelled", None, soak.now(), hang, storm=True))
                return
            outcome = task.result()[0]
            outcome.storm = True
            soak.outcomes.append(outcome)

        await asyncio.gather(*(one(i) for i in range(size)))


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def sample_memory(soak: Soak, serve_pid: int, samples: list[dict], every_s: float) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        while not soak.stop:
            row = {"t": round(soak.now(), 1), "gateway": rss_mb(serve_pid)}
            try:
                status = (await client.get(soak.url + "/gateway/status")).json()
                for i, replica in enumerate(status["replicas"]):
                    pid = (replica.get("process") or {}).get("pid")
                    row[f"engine{i}"] = rss_mb(pid) if pid else None
                    row[f"engine{i}_pid"] = pid
                row["in_flight"] = sum(r["in_flight"] for r in status["replicas"])
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            samples.append(row)
            await asyncio.sleep(every_s)


async def kill_and_watch(soak: Soak, at_s: float, events: dict) -> None:
    await asyncio.sleep(at_s)
    async with httpx.AsyncClient(timeout=5) as client:
        victim = (await client.get(soak.url + "/gateway/status")).json()["replicas"][0]
        os.kill(victim["process"]["pid"], signal.SIGKILL)
        events["killed_at_s"] = round(soak.now(), 2)
        events["killed"] = victim["url"]
        while not soak.stop:
            await asyncio.sleep(0.5)
            now = next(r for r in (await client.get(soak.url + "/gateway/status")).json()["replicas"]
                       if r["url"] == victim["url"])
            if now["healthy"] and now["process"]["restarts"] >= 1:
                events["back_at_s"] = round(soak.now(), 2)
                events["restarts"] = now["process"]["restarts"]
                return


async def drive(args: argparse.Namespace, url: str, serve_pid: int, users: int) -> dict:
    soak = Soak(url, args.model, Workload(get_profile(args.profile), args.seed, load_counter(args.model)))
    rng = random.Random(args.seed)
    samples: list[dict] = []
    events: dict = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(
            total=args.request_timeout)) as http:
        tasks = [asyncio.create_task(chat_user(soak, http, random.Random(rng.random()))) for _ in range(users)]
        side = [asyncio.create_task(sample_memory(soak, serve_pid, samples, args.memory_every)),
                asyncio.create_task(kill_and_watch(soak, args.duration * args.kill_at, events))]

        async def storm_later() -> None:
            await asyncio.sleep(args.duration * args.storm_at)
            events["storm_at_s"] = round(soak.now(), 2)
            await storm(soak, args.storm_size, rng)
            events["storm_done_s"] = round(soak.now(), 2)

        side.append(asyncio.create_task(storm_later()))
        await asyncio.sleep(args.duration)
        soak.stop = True
        await asyncio.wait(tasks, timeout=args.request_timeout + 5)
        for task in side:
            task.cancel()
        await asyncio.gather(*side, return_exceptions=True)
    async with httpx.AsyncClient(timeout=5) as client:  # slots held after the load ended = leaks
        await asyncio.sleep(2)
        final = (await client.get(url + "/gateway/status")).json()
    return {"outcomes": soak.outcomes, "memory": samples, "events": events, "final_status": final}


def serve_argv(args: argparse.Namespace, port: int, *caps: str) -> list[str]:
    return CLI + ["serve", "--replicas", "2", "--model", args.model, "--threads-per-replica", "1", "--port", str(port),
                  *caps, *[f"--engine-arg={a}" for a in args.engine_arg]]


def measure_knee(args: argparse.Namespace, logs: Path) -> Path:
    """`chatfleet sweep` (closed loop, the soak's workload profile and SLO) against the fleet the
    soak runs, through an uncapped gateway over two engines (``--knee-through fleet``: the same
    processes on the same cores as the soak), or against one engine alone."""
    port = free_port()
    if args.knee_through == "fleet":
        server = ServerProcess("serve", serve_argv(args, port), port, log_path=logs / "soak-knee-serve.log")
        kind = "none"  # the gateway has no cache reset; each run takes fresh conversations
    else:
        server = ServerProcess("engine", CLI + ["engine", "--model", args.model, "--port", str(port), "--threads", "1",
                                                "--log-level", "warning", "--enable-admin-api", *args.engine_arg],
                               port, env={"OMP_NUM_THREADS": "1"}, log_path=logs / "soak-knee-engine.log")
        kind = "chatfleet"
    out = logs / "soak-knee.json"
    with server:
        server.wait_healthy()
        cmd = CLI + ["sweep", "--url", server.base_url, "--slo", args.slo, "--duration", str(args.knee_duration),
                     "--warmup", "2", "--start", str(args.knee_start), "--max", str(args.knee_max),
                     "--max-points", str(args.knee_points),
                     "--mode", "closed", "--profile", args.profile, "--tokenizer", args.model, "--seed", str(args.seed),
                     "--server-kind", kind, "--out", str(out)]
        import subprocess

        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def per_replica(fleet: KneeCap, replicas: int) -> KneeCap:
    """One replica's share of a fleet's knee (the gateway spreads sessions evenly)."""
    in_flight = fleet.in_flight / replicas
    return KneeCap(knee=fleet.knee / replicas, mode=fleet.mode, in_flight=in_flight, cap=max(1, int(in_flight)))


def memory_trend(samples: list[dict], key: str, warm_s: float) -> list[dict]:
    """RSS of one process slot after warm-up: one entry per process that lived there (a killed
    and restarted engine has two), each with its slope in MB/min (least squares) over the
    samples taken ``warm_s`` or more after the soak, or that process, started."""
    lives: dict[int | None, list[tuple[float, float]]] = {}
    for m in samples:
        if m.get(key):
            lives.setdefault(m.get(f"{key}_pid"), []).append((m["t"], m[key]))
    out = []
    for pid, series in lives.items():
        born = series[0][0] if out else 0.0  # a later life starts when its process did
        kept = [(t, v) for t, v in series if t - born >= warm_s]
        if len(kept) < 3:
            out.append({"pid": pid, "samples": len(kept), "from_s": born})
            continue
        ts, vs = [t for t, _ in kept], [v for _, v in kept]
        tm, vm = sum(ts) / len(ts), sum(vs) / len(vs)
        slope = sum((t - tm) * (v - vm) for t, v in kept) / sum((t - tm) ** 2 for t in ts)
        out.append({"pid": pid, "samples": len(kept), "from_s": round(ts[0], 1), "to_s": round(ts[-1], 1),
                    "first_mb": round(vs[0], 1), "last_mb": round(vs[-1], 1), "max_mb": round(max(vs), 1),
                    "slope_mb_per_min": round(60 * slope, 2)})
    return out


def summarize(run: dict, args: argparse.Namespace, knee: KneeCap, users: int, slo: SLO, queue_wait: float) -> dict:
    warm = args.duration * args.warmup_share
    outs = run["outcomes"]
    by_kind: dict[str, int] = {}
    storm_kinds: dict[str, int] = {}
    for o in outs:
        kinds = storm_kinds if o.storm else by_kind
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    chats = [o for o in outs if not o.storm]
    measured = [o for o in chats if o.sent >= warm]
    # admitted: the gateway let it through (a reply, an explicit error, or lost on the way)
    admitted = [o for o in measured if o.kind in ("ok", "error", "lost")]
    ok = [o for o in admitted if o.kind == "ok"]
    inf = float("inf")
    ttfts = [o.ttft_s if o.kind == "ok" and o.ttft_s is not None else inf for o in admitted]
    itls = [x for o in ok for x in o.itl_s]
    inside = [o for o in ok if slo.request_ok({"ttft": o.ttft_s, "itl": o.itl_s})]
    slo_values = {t.key: stat_of({"ttft": ttfts, "itl": itls}[t.metric], t.stat) for t in slo.targets}
    refused = [o for o in chats if o.kind == "refused"]
    final = run["final_status"]

    def pct(xs: list[float], q: float) -> float | None:
        return None if not xs else round(1e3 * percentile(xs, q), 1)

    finite = [x for x in ttfts if x != inf]
    return {
        "knee": asdict(knee), "replicas": 2, "users": users, "duration_s": args.duration,
        "max_queue_wait_s": queue_wait, "warmup_s": warm,
        "offered": len(chats), "admitted": sum(o.kind in ("ok", "error", "lost") for o in chats),
        "refused": len(refused), "outcomes": by_kind, "storm_outcomes": storm_kinds,
        "lost": by_kind.get("lost", 0) + storm_kinds.get("lost", 0),
        "admitted_after_warmup": len(admitted), "inside_slo": len(inside),
        "inside_slo_share": round(len(inside) / len(admitted), 4) if admitted else None,
        "slo": str(slo), "slo_values_ms": {k: round(1e3 * v, 1) for k, v in slo_values.items()},
        "slo_met": all(t.ok(slo_values[t.key]) for t in slo.targets),
        "ttft_ms": {"p50": pct(finite, 50), "p95": pct(finite, 95), "p99": pct(finite, 99)},
        "itl_ms": {"p50": pct(itls, 50), "p95": pct(itls, 95), "p99": pct(itls, 99)},
        "refusal_new_ms": {q: pct([o.elapsed_s for o in refused if not o.returning], n)
                           for q, n in (("p50", 50), ("p99", 99))},
        "refusal_returning_ms": {q: pct([o.elapsed_s for o in refused if o.returning], n)
                                 for q, n in (("p50", 50), ("p99", 99))},
        "returning_turns": sum(o.returning for o in chats if o.kind != "cancelled"),
        "refused_returning": sum(o.returning for o in refused),
        "refused_new": sum(not o.returning for o in refused),
        "gateway_shed": {"new": final.get("shed_new"), "returning": final.get("shed_returning")},
        "in_flight_after": sum(r["in_flight"] for r in final["replicas"]),
        "memory": {k: memory_trend(run["memory"], k, warm) for k in ("gateway", "engine0", "engine1")},
        "events": run["events"],
        "lost_examples": [o.detail for o in outs if o.kind == "lost"][:5],
        "error_examples": sorted({o.detail for o in outs if o.kind == "error"})[:5],
    }


def print_table(s: dict) -> None:
    k = s["knee"]
    rows = [
        ("fleet", (f"2 engines, each capped at {k['cap']} requests in flight (knee {k['knee']:g} live chats = "
                  f"{k['in_flight']:.2f} in flight); {s['users']} live chats offered; queue wait <= "
                  f"{s['max_queue_wait_s']:g} s")),
        ("requests offered / admitted / refused", f"{s['offered']} / {s['admitted']} / {s['refused']}"),
        ("requests", ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items()))),
        ("storm requests", ", ".join(f"{k} {v}" for k, v in sorted(s["storm_outcomes"].items()))),
        ("lost (no reply, no error)", str(s["lost"])),
        (f"SLO {s['slo']} over admitted", ", ".join(f"{k} {v} ms" for k, v in s["slo_values_ms"].items())
         + (" (met)" if s["slo_met"] else " (MISSED)")),
        ("admitted requests inside the SLO", (f"{s['inside_slo']}/{s['admitted_after_warmup']} "
                                             f"({100 * (s['inside_slo_share'] or 0):.1f}%)")),
        ("TTFT ms p50/p95/p99", "/".join(str(s["ttft_ms"][q]) for q in ("p50", "p95", "p99"))),
        ("ITL ms p50/p95/p99", "/".join(str(s["itl_ms"][q]) for q in ("p50", "p95", "p99"))),
        ("refusal latency ms p50/p99: new", f"{s['refusal_new_ms']['p50']}/{s['refusal_new_ms']['p99']}"),
        ("refusal latency ms p50/p99: returning", (f"{s['refusal_returning_ms']['p50']}/"
                                                  f"{s['refusal_returning_ms']['p99']}")),
        ("refused: new / returning turns", (f"{s['refused_new']} / {s['refused_returning']} "
                                           f"(of {s['returning_turns']} returning turns sent)")),
        ("replica killed / back", f"{s['events'].get('killed_at_s')} s / {s['events'].get('back_at_s')} s"),
        ("storm", f"{s['events'].get('storm_at_s')} s .. {s['events'].get('storm_done_s')} s"),
        ("slots held after the load", str(s["in_flight_after"])),
    ]
    for name, lives in s["memory"].items():
        for life in lives:
            if "slope_mb_per_min" in life:
                rows.append((f"RSS {name} (pid {life['pid']}) {life['from_s']:g}-{life['to_s']:g} s",
                             (f"{life['first_mb']} -> {life['last_mb']} MB, max {life['max_mb']}, "
                             f"{life['slope_mb_per_min']:+.2f} MB/min")))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--model", default="tiny")
    p.add_argument("--knee-from", type=Path, default=None,
                   help="a `chatfleet sweep` JSON result (closed loop, this profile) to read the knee from "
                        "(default: measure it)")
    p.add_argument("--knee-through", choices=("fleet", "engine"), default="fleet",
                   help="the knee is measured (or --knee-from was) through the soak's gateway over two "
                        "engines (each engine's share: half), or against one engine alone")
    p.add_argument("--knee", type=int, default=None, help="live chats one engine holds (needs --cap)")
    p.add_argument("--cap", type=int, default=None, help="requests in flight one engine holds (with --knee)")
    p.add_argument("--knee-duration", type=float, default=10.0, help="measured seconds per sweep point")
    p.add_argument("--knee-points", type=int, default=8, help="most sweep points")
    p.add_argument("--knee-start", type=int, default=8, help="the sweep's first level (live chats)")
    p.add_argument("--knee-max", type=int, default=256, help="the sweep's highest level (live chats)")
    p.add_argument("--profile", default="cpu-roleplay", help="workload profile (the sweep's and the soak's)")
    p.add_argument("--load-factor", type=float, default=2.0, help="offered live chats / the fleet's knee")
    p.add_argument("--slo", default="ttft_p95<=1s,itl_p95<=200ms")
    p.add_argument("--queue-share", type=float, default=0.1,
                   help="the gateway's --max-queue-wait as a share of the TTFT target (a returning turn waits "
                        "this long at most for a slot; the wait counts in its TTFT)")
    p.add_argument("--max-queued-new", type=int, default=0,
                   help="the gateway's --max-queued-new (0: a new conversation over the caps is refused at once)")
    p.add_argument("--kill-at", type=float, default=0.5, help="share of the duration")
    p.add_argument("--storm-at", type=float, default=0.75, help="share of the duration")
    p.add_argument("--storm-size", type=int, default=200)
    p.add_argument("--warmup-share", type=float, default=0.3,
                   help="share of the duration left out of SLO and memory figures (engines fill pools, caches)")
    p.add_argument("--memory-every", type=float, default=5.0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--engine-arg", action="append", default=[], help="extra `chatfleet engine` flag")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "results" / "soak.json")
    args = p.parse_args()

    logs = args.out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    slo = parse_slo(args.slo)
    if args.knee is not None or args.cap is not None:
        if args.knee is None or args.cap is None:
            p.error("give --knee (live chats) and --cap (requests in flight) together")
        knee = KneeCap(knee=args.knee, mode="closed", in_flight=args.cap, cap=args.cap)
    else:
        started = time.monotonic()
        knee = knee_cap(args.knee_from if args.knee_from is not None else measure_knee(args, logs))
        if args.knee_through == "fleet":
            print(f"fleet (2 engines): {knee.describe()}", flush=True)
            knee = per_replica(knee, 2)
        print(f"knee measured in {time.monotonic() - started:.0f} s", flush=True)
    users = max(1, round(args.load_factor * 2 * knee.knee))
    ttft_target = next((t.threshold_s for t in slo.targets if t.metric == "ttft"), 1.0)
    queue_wait = round(args.queue_share * ttft_target, 3)
    port = free_port()
    serve = ServerProcess("serve", serve_argv(
        args, port, "--max-in-flight", str(knee.cap), "--queue-size", str(2 * knee.cap), "--max-queue-wait",
        str(queue_wait), "--max-queued-new", str(args.max_queued_new)), port, log_path=logs / "soak-serve.log")
    print(f"{knee.describe()} per engine; {users} live chats ({args.load_factor:g} x 2 engines x knee) for "
          f"{args.duration:g} s through {serve.base_url}; queue wait <= {queue_wait:g} s (load {load_average()})",
          flush=True)
    with serve:
        serve.wait_healthy()
        run = asyncio.run(drive(args, serve.base_url, serve.proc.pid, users))
    summary = summarize(run, args, knee, users, slo, queue_wait)
    summary["load_average_end"] = load_average()
    print_table(summary)
    doc = {"settings": vars(args) | {"out": str(args.out), "knee_from": str(args.knee_from)}, "summary": summary,
           "memory_samples": run["memory"],
           "outcomes": [asdict(o) | {"itl_s": None} for o in run["outcomes"]]}
    args.out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
