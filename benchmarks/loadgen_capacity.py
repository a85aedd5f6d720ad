"""Can the load generator alone hold thousands of live streaming chats with accurate timing?

Runs `chatfleet.bench` closed-loop role-play chats against the scripted test server (its own
process, fixed TTFT/ITL, every chunk stamped with its send time on the shared monotonic clock)
and reports the client's timing error: TTFT error (first token's arrival as timed vs sent) and
ITL error (each gap as timed vs as made), at p50/p99/max, with streams in flight, chunks per
second and client CPU. Compares transports (raw asyncio streams, httpx) and event loops.

    python benchmarks/loadgen_capacity.py --chats 2200 --duration 20
Prints a table and writes benchmarks/results/loadgen_capacity.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from chatfleet.bench.client import ClientConfig
from chatfleet.bench.dists import make
from chatfleet.bench.loops import LoadSpec, raise_fd_limit, run_load
from chatfleet.bench.tokens import EstimateCounter
from chatfleet.bench.transport import make_transport
from chatfleet.bench.workload import Workload, get_profile


def schedstat(pid: int | str = "self") -> tuple[int, int]:
    """(ns on CPU, ns runnable but waiting for a CPU) of a process, from /proc/PID/schedstat."""
    try:
        run, wait, _ = open(f"/proc/{pid}/schedstat").read().split()
        return int(run), int(wait)
    except (OSError, ValueError):
        return 0, 0


def start_server(ttft_ms: float, itl_ms: float) -> tuple[subprocess.Popen, str]:
    raise_fd_limit(8192)
    proc = subprocess.Popen([sys.executable, "-m", "chatfleet.testing.fake_server", "--port", "0",
                             "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


async def measure(url: str, server_pid: int, transport: str, chats: int, duration: float, warmup: float, think_s: float,
                  reply: tuple[int, int]) -> dict:
    profile = get_profile("cpu-roleplay").with_overrides(
        reply_tokens=make("uniform", low=reply[0], high=reply[1]),
        think_time_s=make("lognormal", mean=think_s, sigma=0.5, min=0.2, max=think_s * 4),
        turns=make("uniform", low=3, high=8))
    w = Workload(profile, 1, EstimateCounter())
    streams: dict[int, list[tuple[int, int]]] = {}
    t_warm = time.perf_counter_ns() + int(warmup * 1e9)
    inflight_samples: list[int] = []

    def probe(recv_ns: int, obj: dict) -> None:
        if "x_sent_ns" in obj and recv_ns >= t_warm:
            streams.setdefault(obj["x_req"], []).append((recv_ns, obj["x_sent_ns"]))

    async def sampler() -> None:
        http = make_transport("httpx", url)
        try:
            while True:
                await asyncio.sleep(0.5)
                try:
                    r = await http.client.get(url + "/metrics", timeout=5.0)
                except Exception:  # an overloaded server: skip this sample
                    continue
                for line in r.text.splitlines():
                    if line.startswith("vllm:num_requests_running"):
                        inflight_samples.append(int(float(line.split()[-1])))
        finally:
            await http.close()

    t = make_transport(transport, url)
    cfg = ClientConfig("scripted", on_chunk=probe, request_timeout_s=60)
    spec = LoadSpec("closed", chats, duration_s=duration, warmup_s=warmup, drain_timeout_s=30)
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    c0, s0 = schedstat(), schedstat(server_pid)
    samp = asyncio.create_task(sampler())
    res = await run_load(w, t, cfg, spec, seed=1)
    samp.cancel()
    await asyncio.gather(samp, return_exceptions=True)
    wall, ru1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    c1, s1 = schedstat(), schedstat(server_pid)
    await t.close()
    ttft = np.array([(s[0][0] - s[0][1]) / 1e6 for s in streams.values()]) if streams else np.zeros(1)
    itl = np.array([abs((r1 - r0) - (s1 - s0)) / 1e6
                    for s in streams.values() for (r0, s0), (r1, s1) in itertools.pairwise(s)])
    recs = [r for r in res.records if not r.warmup]
    chunks = sum(len(s) for s in streams.values())
    return {
        "transport": transport, "chats": chats, "requests": len(recs),
        "failed": sum(r.status != "ok" for r in recs),
        "streams_in_flight_mean": float(np.mean(inflight_samples)) if inflight_samples else None,
        "streams_in_flight_max": max(inflight_samples) if inflight_samples else None,
        "chunks_per_s": chunks / duration,
        "client_cpu_share": (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / wall,
        "ttft_error_ms": {"p50": float(np.percentile(ttft, 50)), "p99": float(np.percentile(ttft, 99)),
                          "max": float(ttft.max())},
        "itl_error_ms": {"p50": float(np.percentile(itl, 50)), "p99": float(np.percentile(itl, 99)),
                         "max": float(itl.max())} if itl.size else None,
        # Share of wall time each process was runnable but had no CPU (other work on the machine).
        "client_runqueue_wait_share": (c1[1] - c0[1]) / 1e9 / wall,
        "server_cpu_share": (s1[0] - s0[0]) / 1e9 / wall,
        "server_runqueue_wait_share": (s1[1] - s0[1]) / 1e9 / wall,
        "client_queue_ms_p99": float(np.percentile([r.queue_s * 1e3 for r in recs if r.queue_s is not None], 99)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=2200)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--ttft-ms", type=float, default=100.0)
    ap.add_argument("--itl-ms", type=float, default=50.0, help="server's gap between tokens of one stream")
    ap.add_argument("--think-s", type=float, default=3.0, help="mean think time between turns")
    ap.add_argument("--reply", default="20,60", help="reply tokens low,high")
    ap.add_argument("--transports", default="raw,httpx")
    ap.add_argument("--loops", default="asyncio,uvloop")
    ap.add_argument("--out", default="benchmarks/results/loadgen_capacity.json")
    ap.add_argument("--nice", type=int, default=-10, help="priority change for this process and the server "
                    "(negative needs root; a busy machine otherwise deschedules the client for ms at a time)")
    ap.add_argument("--realtime", action="store_true",
                    help="run this process and the server under SCHED_RR (root; the kernel caps RT time at 95%%)")
    a = ap.parse_args()
    if a.realtime:
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))
        except (PermissionError, AttributeError, OSError) as e:
            print(f"cannot switch to real-time scheduling ({e}); running normally")
    if a.nice:
        try:
            os.nice(a.nice)
        except PermissionError:
            print(f"cannot change priority by {a.nice} (not root); running at normal priority")
    reply = tuple(int(x) for x in a.reply.split(","))
    rows = []
    proc, url = start_server(a.ttft_ms, a.itl_ms)
    try:
        for loop in a.loops.split(","):
            for tr in a.transports.split(","):
                coro = measure(url, proc.pid, tr, a.chats, a.duration, a.warmup, a.think_s, reply)
                if loop == "uvloop":
                    try:
                        import uvloop
                    except ImportError:
                        print("uvloop not installed; skipping")
                        continue
                    row = uvloop.run(coro)
                else:
                    row = asyncio.run(coro)
                row["loop"] = loop
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
        proc.wait()
    print(f"\n{'loop':8} {'transport':9} {'chats':>5} {'in flight':>9} {'chunks/s':>8} {'cpu':>5} "
          f"{'TTFT err p50/p99/max ms':>24} {'ITL err p50/p99/max ms':>23} {'failed':>6} {'srv cpu':>7}"
          f" {'cli/srv wait':>12}")
    for r in rows:
        t, i = r["ttft_error_ms"], r["itl_error_ms"] or {"p50": 0, "p99": 0, "max": 0}
        print(f"{r['loop']:8} {r['transport']:9} {r['chats']:5d} {r['streams_in_flight_mean'] or 0:9.0f} "
              f"{r['chunks_per_s']:8.0f} {r['client_cpu_share']:5.2f} "
              f"{t['p50']:7.2f}/{t['p99']:6.2f}/{t['max']:7.1f}   {i['p50']:6.2f}/{i['p99']:6.2f}/{i['max']:7.1f} "
              f"{r['failed']:6d} {r['server_cpu_share']:7.2f} "
              f"{r['client_runqueue_wait_share']:5.2f}/{r['server_runqueue_wait_share']:5.2f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
