"""How closely does the bench client time what a server sent? (a few streams, no load)

The scripted test server (its own process) stamps every chunk with its send time on the shared
monotonic clock, so the client's error is measured per token, not guessed. Reports, per transport:

- TTFT error: the first chunk's arrival as the client timed it minus the server's send time;
- ITL error: each gap as the client timed it minus the gap the server made (absolute);
- the scripted delays as the client saw them (TTFT after the send, median gap) against the script;
- with three tokens per chunk, each token's share of the chunk's gap against the scripted share.

Figures (median, p75, p99, max in ms; ratios to the script), never pass/fail: a busy machine
deschedules the client now and then, which is the machine, not the method. The tests keep the
functional side (counts, ordering, the client's arithmetic). For thousands of chats in flight
see loadgen_capacity.py.

    python benchmarks/client_timing.py                 # ~10 s
    python benchmarks/client_timing.py --duration 5
Prints a table and writes benchmarks/results/client_timing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from chatfleet.bench.client import ClientConfig
from chatfleet.bench.loops import LoadSpec, run_load
from chatfleet.bench.tokens import EstimateCounter
from chatfleet.bench.transport import make_transport
from chatfleet.bench.workload import Workload, get_profile

RESULTS = Path(__file__).resolve().parent / "results"


@contextlib.contextmanager
def scripted_server(*args: str):
    proc = subprocess.Popen([sys.executable, "-m", "chatfleet.testing.fake_server", "--port", "0", *args],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("PORT "):
            raise SystemExit(f"scripted server did not start: {line!r}")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def run(url: str, spec: LoadSpec, cfg: ClientConfig, transport: str):
    w = Workload(get_profile("cpu-roleplay"), 1, EstimateCounter())

    async def go():
        t = make_transport(transport, url)
        try:
            return await run_load(w, t, cfg, spec, 1)
        finally:
            await t.close()

    return asyncio.run(go())


def figures(ms: np.ndarray) -> dict[str, float | int]:
    if not len(ms):
        return {"n": 0}
    return {"n": len(ms), "median_ms": round(float(np.median(ms)), 3),
            "p75_ms": round(float(np.percentile(ms, 75)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3),
            "max_ms": round(float(ms.max()), 3)}


def single_token(transport: str, ttft_ms: float, itl_ms: float, streams_n: int, duration: float) -> dict:
    streams: dict[int, list[tuple[int, int]]] = {}

    def probe(recv_ns, obj):
        if "x_sent_ns" in obj:
            streams.setdefault(obj["x_req"], []).append((recv_ns, obj["x_sent_ns"]))

    with scripted_server("--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms)) as url:
        res = run(url, LoadSpec("closed", streams_n, duration_s=duration, warmup_s=0.0, drain_timeout_s=10),
                  ClientConfig("scripted", on_chunk=probe), transport)
    ok = [r for r in res.records if r.status == "ok"]
    ttft_err = np.array([(s[0][0] - s[0][1]) / 1e6 for s in streams.values()])
    itl_err = np.abs(np.array([((r1 - r0) - (s1 - s0)) / 1e6 for s in streams.values()
                               for (r0, s0), (r1, s1) in itertools.pairwise(s)]))
    ttft_seen = np.array([(r.ttft_s - r.queue_s) * 1e3 for r in ok])
    gaps = np.array([g * 1e3 for r in ok for g in r.itl_s])
    return {"transport": transport, "requests": len(ok), "ttft_error": figures(ttft_err),
            "itl_error": figures(itl_err),
            "ttft_after_send_vs_script": round(float(np.median(ttft_seen)) / ttft_ms, 3) if len(ttft_seen) else None,
            "median_gap_vs_script": round(float(np.median(gaps)) / itl_ms, 3) if len(gaps) else None}


def multi_token(itl_ms: float, per_chunk: int, duration: float) -> dict:
    with scripted_server("--ttft-ms", "20", "--itl-ms", str(itl_ms), "--tokens-per-chunk", str(per_chunk)) as url:
        res = run(url, LoadSpec("concurrency", 2, duration_s=duration, warmup_s=0.0, drain_timeout_s=10),
                  ClientConfig("scripted", continuous_usage=True), "raw")
    gaps = np.array([g * 1e3 for r in res.records if r.status == "ok" for g in r.itl_s])
    return {"tokens_per_chunk": per_chunk, "gaps": len(gaps),
            "median_token_share_vs_script": round(float(np.median(gaps)) / itl_ms, 3) if len(gaps) else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=3.0, help="seconds of load per measurement")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--ttft-ms", type=float, default=40.0)
    ap.add_argument("--itl-ms", type=float, default=15.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "client_timing.json")
    a = ap.parse_args()
    rows = [single_token(t, a.ttft_ms, a.itl_ms, a.streams, a.duration) for t in ("raw", "httpx")]
    chunked = multi_token(10.0, 3, a.duration / 2)
    print(f"{'transport':<10}{'reqs':>6}  {'TTFT err p50/p75/p99 ms':<26}{'ITL err p50/p75/p99 ms':<26}"
          f"{'TTFT/script':>12}{'gap/script':>11}")
    for r in rows:
        t, i = r["ttft_error"], r["itl_error"]
        print(f"{r['transport']:<10}{r['requests']:>6}  "
              f"{t.get('median_ms', 0):>6.2f} {t.get('p75_ms', 0):>6.2f} {t.get('p99_ms', 0):>6.2f}       "
              f"{i.get('median_ms', 0):>6.2f} {i.get('p75_ms', 0):>6.2f} {i.get('p99_ms', 0):>6.2f}       "
              f"{r['ttft_after_send_vs_script'] or 0:>12.3f}{r['median_gap_vs_script'] or 0:>11.3f}")
    print(f"3 tokens per chunk: each token's share of the gap / scripted share = "
          f"{chunked['median_token_share_vs_script']} over {chunked['gaps']} gaps")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "load_average": os.getloadavg(),
                                 "single_token": rows, "multi_token": chunked}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
