"""Hostile bodies under the size limit vs a running stream (issue 23, point 5).

A server (the engine, or a gateway in front of it) streams one reply; while it does, the
benchmark sends bodies under the 8 MiB limit that no context can hold, and measures the stream's
largest inter-token gap during them against its largest gap alone (the target: within 2x):

- ``long``: one 7.8 MB message;
- ``many``: 65,000 short messages, 7.8 MB in all;
- ``100x1MB``: 100 concurrent 1 MB bodies.

Each hostile reply's status and latency are recorded too (a 400 that names the length, soon).
The stream is read by a process of its own (the client sending the bodies must not stall the
reading), and the machine's load average before and after goes in the results.

    python benchmarks/hostile_bodies.py --model tiny --threads 1
    python benchmarks/hostile_bodies.py --via engine,gateway
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from backends import BACKENDS  # noqa: E402
from chatfleet.engine.builtin_models.tiny import resolve_model  # noqa: E402
from common import RESULTS_DIR, ServerProcess  # noqa: E402

STREAM_TOKENS = 600
WARM_TOKENS = 30


def long_body(size: int) -> bytes:
    word = "harbor "
    return json.dumps({"messages": [{"role": "user", "content": word * (size // len(word))}],
                       "max_tokens": 8}).encode()


def many_body(size: int, n: int = 65_000) -> bytes:
    text = "x" * max(1, size // n - 40)
    return json.dumps({"messages": [{"role": "user", "content": text} for _ in range(n)],
                       "max_tokens": 8}).encode()


SCENARIOS = {
    "long": lambda: [long_body(7_800_000)],
    "many": lambda: [many_body(7_800_000)],
    "100x1MB": lambda: [long_body(1_000_000)] * 100,
}


async def _stream(client: httpx.AsyncClient, url: str, model: str, arrivals: list[float],
                  started: asyncio.Event) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": STREAM_TOKENS, "min_tokens": STREAM_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
                if len(arrivals) == WARM_TOKENS:
                    started.set()


def _read_stream(url: str, model: str, arrivals_out: Queue, warm: Event) -> None:
    """The running stream, read by a process of its own: the hostile client's work (sending
    100 MB, reading replies) must not delay the reading and count as the server's stall.
    perf_counter is the system's monotonic clock, so both processes' times compare."""

    async def run() -> list[float]:
        arrivals: list[float] = []
        started = asyncio.Event()
        async with httpx.AsyncClient(timeout=600) as client:
            task = asyncio.create_task(_stream(client, url, model, arrivals, started))
            await started.wait()
            warm.set()
            await task
        return arrivals

    arrivals_out.put(asyncio.run(run()))


async def _hostile(client: httpx.AsyncClient, url: str, body: bytes) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    r = await client.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    msg = ""
    try:
        msg = r.json()["error"]["message"][:120]
    except (ValueError, KeyError, TypeError):
        pass
    return r.status_code, time.perf_counter() - t0, msg


def _gaps(arrivals: list[float], t0: float | None = None, t1: float | None = None) -> list[float]:
    out = []
    for a, b in zip(arrivals[WARM_TOKENS // 2:], arrivals[WARM_TOKENS // 2 + 1:], strict=False):
        if t0 is None or (b >= t0 and a <= t1):
            out.append(b - a)
    return out


async def _send_all(url: str, bodies: list[bytes]) -> tuple[float, float, list[tuple[int, float, str]]]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=200)) as client:
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(_hostile(client, url, b) for b in bodies))
        return t0, time.perf_counter(), replies


def scenario(url: str, model: str, bodies: list[bytes] | None) -> dict:
    ctx = multiprocessing.get_context("spawn")
    arrivals_out, warm = ctx.Queue(), ctx.Event()
    reader = ctx.Process(target=_read_stream, args=(url, model, arrivals_out, warm))
    reader.start()
    warm.wait(120)
    out: dict = {}
    t0 = t1 = None
    if bodies:
        t0, t1, replies = asyncio.run(_send_all(url, bodies))
        out.update(window_s=t1 - t0, statuses=sorted({s for s, _, _ in replies}),
                   reply_s_max=max(d for _, d, _ in replies), message=replies[0][2])
    arrivals = arrivals_out.get(timeout=600)
    reader.join(60)
    gaps = sorted(_gaps(arrivals, t0, t1))
    out.update(max_gap_ms=1e3 * gaps[-1], p99_gap_ms=1e3 * gaps[int(0.99 * (len(gaps) - 1))],
               median_gap_ms=1e3 * statistics.median(gaps), gaps=len(gaps), tokens=len(arrivals))
    return out


def run_target(url: str, model: str, label: str) -> dict:
    results = {"alone": scenario(url, model, None)}
    for name, make in SCENARIOS.items():
        results[name] = scenario(url, model, make())
    alone = results["alone"]["max_gap_ms"]
    print(f"{label}: largest inter-token gap of a running stream (alone {alone:.1f} ms,"
          f" median {results['alone']['median_gap_ms']:.1f} ms)")
    for name in SCENARIOS:
        r = results[name]
        r["vs_alone"] = r["max_gap_ms"] / alone
        print(f"  {name:>8}: {r['max_gap_ms']:8.1f} ms ({r['vs_alone']:.2f}x; p99 {r['p99_gap_ms']:.1f} ms),"
              f" hostile replies {r['statuses']} in <= {r['reply_s_max']:.2f} s: {r['message']}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--via", default="engine,gateway")
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    spec = BACKENDS["ours"].launch(model_dir, 8970, args.threads, 256 << 20, 32768)
    logs = RESULTS_DIR / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out: dict = {"model": args.model, "threads": args.threads, "load_average_before": os.getloadavg()}
    with ServerProcess("engine", spec.argv, 8970, spec.env, logs / "hostile_engine.log") as engine:
        engine.wait_healthy()
        via = [v.strip() for v in args.via.split(",")]
        if "engine" in via:
            out["engine"] = run_target(engine.base_url, spec.request_model, "engine")
        if "gateway" in via:
            argv = [sys.executable, "-m", "chatfleet.cli.main", "gateway", "--replica", engine.base_url,
                    "--port", "8971", "--log-level", "warning"]
            with ServerProcess("gateway", argv, 8971, {}, logs / "hostile_gateway.log") as gw:
                gw.wait_healthy()
                out["gateway"] = run_target(gw.base_url, spec.request_model, "gateway")
    out["load_average_after"] = os.getloadavg()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "hostile_bodies.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
