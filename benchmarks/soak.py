"""Soak: twice the fleet's capacity for a long while, a replica killed halfway, a disconnect storm.

`chatfleet serve` runs two engines behind the gateway, each capped at the measured knee (the
live chats one engine holds inside the SLO; measured first with `chatfleet sweep` against one
engine unless given with --knee). Then closed-loop chats, `--load-factor` times the fleet's
capacity (2 x knee x 2 replicas by default), talk through the gateway for --duration seconds:
multi-turn conversations with their own session ids, streamed replies, a think time between
turns; a refused turn (429/503) waits its Retry-After and tries again. Halfway, one engine is
killed with SIGKILL and `serve` starts it again; at --storm-at, --storm-size extra clients
open streams and hang up after their first chunk or at random. Every request ends in exactly
one outcome: ok (a complete reply), refused (429/503, with how long the refusal took), error
(an explicit error: an error status or an SSE error event), cancelled (the storm hung up),
or lost (no reply and no explicit error: the number that must be zero). The RSS of the gateway
and of each engine is sampled throughout.

    python benchmarks/soak.py                         # 10 minutes, tiny, knee measured first
    python benchmarks/soak.py --duration 60 --knee 8  # a quick check

Prints a table and writes JSON (default benchmarks/results/soak.json; logs beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import httpx

from chatfleet.gateway.config import read_knee
from chatfleet.loopback import free_port
from chatfleet.protocol.sse import DataSplitter

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import ServerProcess, load_average, percentile  # noqa: E402

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
    max_tokens: int
    think_s: float
    turns: int
    t0: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    stop: bool = False
    sessions: set[str] = field(default_factory=set)  # conversations in progress

    def now(self) -> float:
        return time.monotonic() - self.t0


async def one_turn(soak: Soak, http: aiohttp.ClientSession, session: str, messages: list[dict],
                   returning: bool, hang_up_after_s: float | None = None) -> tuple[Outcome, str, float]:
    """One streamed request; returns its outcome, the reply text and the Retry-After (s)."""
    body = {"model": soak.model, "messages": messages, "stream": True, "max_tokens": soak.max_tokens}
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
    """One live chat after another: turns with a think time; a refused turn is tried again."""
    while not soak.stop:
        session = uuid.uuid4().hex
        messages = [{"role": "system", "content": f"You are character {rng.randrange(1000)}."},
                    {"role": "user", "content": f"Hello, I am user {session[:8]}. Tell me a story."}]
        turn = 0
        soak.sessions.add(session)
        while turn < soak.turns and not soak.stop:
            outcome, reply, retry_after = await one_turn(soak, http, session, messages, returning=turn > 0)
            soak.outcomes.append(outcome)
            if outcome.kind == "refused":
                await asyncio.sleep(retry_after * (0.5 + rng.random()))
                continue
            if outcome.kind != "ok":
                break  # an error or a lost reply ends this chat; a new one starts
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"And then? ({turn})"}]
            turn += 1
            await asyncio.sleep(rng.uniform(0, 2 * soak.think_s))
        soak.sessions.discard(session)


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
            task = asyncio.ensure_future(one_turn(soak, http, session, messages, returning, hang))
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
    soak = Soak(url, args.model, args.max_tokens, args.think, args.turns)
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


def measure_knee(args: argparse.Namespace, logs: Path) -> float:
    port = free_port()
    engine = ServerProcess("engine", CLI + ["engine", "--model", args.model, "--port", str(port), "--threads", "1",
                                            "--log-level", "warning", "--enable-admin-api", *args.engine_arg], port,
                           env={"OMP_NUM_THREADS": "1"}, log_path=logs / "soak-knee-engine.log")
    out = logs / "soak-knee.json"
    with engine:
        engine.wait_healthy()
        cmd = CLI + ["sweep", "--url", engine.base_url, "--slo", args.slo, "--duration", str(args.knee_duration),
                     "--warmup", "2", "--start", "2", "--max", "64", "--max-points", "6", "--out", str(out)]
        import subprocess

        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return read_knee(out)


def summarize(run: dict, args: argparse.Namespace, knee: int, users: int, slo: dict[str, float]) -> dict:
    warm = args.duration * args.warmup_share
    outs = [o for o in run["outcomes"]]
    by_kind: dict[str, int] = {}
    storm_kinds: dict[str, int] = {}
    for o in outs:
        kinds = storm_kinds if o.storm else by_kind
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    ok = [o for o in outs if o.kind == "ok" and o.sent >= warm and not o.storm]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    itls = [x for o in ok for x in o.itl_s]
    inside = [o for o in ok if (o.ttft_s or 0) <= slo["ttft"] and (percentile(o.itl_s, 95) or 0) <= slo["itl"]]
    refused = [o for o in outs if o.kind == "refused" and not o.storm]
    mem = [m for m in run["memory"] if m["t"] >= warm]

    def flat(key: str) -> dict | None:
        series = [m[key] for m in mem if m.get(key)]
        if key.startswith("engine"):  # only samples of the process alive at the end (a restart starts afresh)
            pids = [m.get(f"{key}_pid") for m in mem if m.get(key)]
            series = [v for v, p in zip(series, pids) if p == pids[-1]][len(series) // 10:] if pids else []
        if len(series) < 2:
            return None
        first, last = series[0], series[-1]
        return {"after_warmup_mb": round(first, 1), "end_mb": round(last, 1), "max_mb": round(max(series), 1),
                "growth_pct": round(100 * (last - first) / first, 2)}

    final = run["final_status"]
    pct = lambda xs, q: None if not xs else round(1e3 * percentile(xs, q), 1)  # noqa: E731
    return {
        "knee_per_replica": knee, "replicas": 2, "users": users, "duration_s": args.duration,
        "outcomes": by_kind, "storm_outcomes": storm_kinds,
        "lost": by_kind.get("lost", 0) + storm_kinds.get("lost", 0),
        "admitted_after_warmup": len(ok), "inside_slo": len(inside),
        "inside_slo_share": round(len(inside) / len(ok), 4) if ok else None,
        "ttft_ms": {"p50": pct(ttfts, 50), "p95": pct(ttfts, 95), "p99": pct(ttfts, 99)},
        "itl_ms": {"p50": pct(itls, 50), "p95": pct(itls, 95), "p99": pct(itls, 99)},
        "refusal_ms": {"p50": pct([o.elapsed_s for o in refused], 50),
                       "p99": pct([o.elapsed_s for o in refused], 99)},
        "refusal_new_ms": {q: pct([o.elapsed_s for o in refused if not o.returning], n)
                           for q, n in (("p50", 50), ("p99", 99))},
        "refusal_returning_ms": {q: pct([o.elapsed_s for o in refused if o.returning], n)
                                 for q, n in (("p50", 50), ("p99", 99))},
        "returning_turns": sum(o.returning for o in outs if not o.storm and o.kind != "cancelled"),
        "refused_returning": sum(o.returning for o in refused),
        "refused_new": sum(not o.returning for o in refused),
        "gateway_shed": {"new": final.get("shed_new"), "returning": final.get("shed_returning")},
        "in_flight_after": sum(r["in_flight"] for r in final["replicas"]),
        "memory": {k: flat(k) for k in ("gateway", "engine0", "engine1")},
        "events": run["events"],
        "lost_examples": [o.detail for o in outs if o.kind == "lost"][:5],
        "error_examples": sorted({o.detail for o in outs if o.kind == "error"})[:5],
    }


def print_table(s: dict, slo_text: str) -> None:
    rows = [
        ("fleet", f"2 engines, cap {s['knee_per_replica']} each; {s['users']} live chats offered"),
        ("requests", ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items()))),
        ("storm requests", ", ".join(f"{k} {v}" for k, v in sorted(s["storm_outcomes"].items()))),
        ("lost (no reply, no error)", str(s["lost"])),
        (f"admitted inside SLO ({slo_text})", f"{s['inside_slo']}/{s['admitted_after_warmup']} "
                                              f"({100 * (s['inside_slo_share'] or 0):.1f}%)"),
        ("TTFT ms p50/p95/p99", "/".join(str(s["ttft_ms"][q]) for q in ("p50", "p95", "p99"))),
        ("ITL ms p50/p95/p99", "/".join(str(s["itl_ms"][q]) for q in ("p50", "p95", "p99"))),
        ("refusal latency ms p50/p99: new", f"{s['refusal_new_ms']['p50']}/{s['refusal_new_ms']['p99']}"),
        ("refusal latency ms p50/p99: returning", f"{s['refusal_returning_ms']['p50']}/"
                                                  f"{s['refusal_returning_ms']['p99']}"),
        ("refused: new / returning turns", f"{s['refused_new']} / {s['refused_returning']} "
                                           f"(of {s['returning_turns']} returning turns sent)"),
        ("replica killed / back", f"{s['events'].get('killed_at_s')} s / {s['events'].get('back_at_s')} s"),
        ("storm", f"{s['events'].get('storm_at_s')} s .. {s['events'].get('storm_done_s')} s"),
        ("slots held after the load", str(s["in_flight_after"])),
    ]
    for name, m in s["memory"].items():
        if m:
            rows.append((f"RSS {name} MB (after warm-up -> end, max)",
                         f"{m['after_warmup_mb']} -> {m['end_mb']} ({m['growth_pct']:+.1f}%), max {m['max_mb']}"))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def parse_slo(text: str) -> dict[str, float]:
    """'ttft_p95<=1s,itl_p95<=200ms' -> {'ttft': 1.0, 'itl': 0.2} (per-request targets)."""
    out = {}
    for part in text.split(","):
        key, value = part.split("<=")
        seconds = float(value[:-2]) / 1e3 if value.endswith("ms") else float(value.rstrip("s"))
        out[key.split("_")[0]] = seconds
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--model", default="tiny")
    p.add_argument("--knee", type=int, default=None, help="live chats one engine holds (default: measure it)")
    p.add_argument("--knee-from", type=Path, default=None, help="a `chatfleet sweep` JSON result to read the knee from")
    p.add_argument("--knee-duration", type=float, default=6.0, help="measured seconds per sweep point")
    p.add_argument("--load-factor", type=float, default=2.0, help="offered chats / fleet capacity")
    p.add_argument("--slo", default="ttft_p95<=1s,itl_p95<=200ms")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--think", type=float, default=1.0, help="mean seconds between a reply and the next turn")
    p.add_argument("--queue-wait", type=float, default=1.0, help="the gateway's --max-queue-wait (a returning turn waits this long at most)")
    p.add_argument("--max-queued-new", type=int, default=0,
                   help="the gateway's --max-queued-new (0: a new conversation over the caps is refused at once)")
    p.add_argument("--kill-at", type=float, default=0.5, help="share of the duration")
    p.add_argument("--storm-at", type=float, default=0.75, help="share of the duration")
    p.add_argument("--storm-size", type=int, default=200)
    p.add_argument("--warmup-share", type=float, default=0.3, help="share of the duration left out of SLO and memory figures (engines fill their pools and caches)")
    p.add_argument("--memory-every", type=float, default=5.0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--engine-arg", action="append", default=[], help="extra `chatfleet engine` flag")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "results" / "soak.json")
    args = p.parse_args()

    logs = args.out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if args.knee is not None:
        knee = args.knee
    elif args.knee_from is not None:
        knee = read_knee(args.knee_from)
    else:
        knee = int(measure_knee(args, logs))
    users = max(1, round(args.load_factor * 2 * knee))
    port = free_port()
    serve = ServerProcess("serve", CLI + [
        "serve", "--replicas", "2", "--model", args.model, "--threads-per-replica", "1", "--port", str(port),
        "--max-in-flight", str(knee), "--queue-size", str(2 * knee), "--max-queue-wait", str(args.queue_wait),
        "--max-queued-new", str(args.max_queued_new),
        *[f"--engine-arg={a}" for a in args.engine_arg]], port, log_path=logs / "soak-serve.log")
    print(f"knee {knee} per engine; {users} live chats for {args.duration:g} s through {serve.base_url} "
          f"(load {load_average()})", flush=True)
    with serve:
        serve.wait_healthy()
        run = asyncio.run(drive(args, serve.base_url, serve.proc.pid, users))
    summary = summarize(run, args, knee, users, parse_slo(args.slo))
    summary["load_average_end"] = load_average()
    print_table(summary, args.slo)
    doc = {"settings": vars(args) | {"out": str(args.out), "knee_from": str(args.knee_from)}, "summary": summary,
           "memory_samples": run["memory"],
           "outcomes": [asdict(o) | {"itl_s": None} for o in run["outcomes"]]}
    args.out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
