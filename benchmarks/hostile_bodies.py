"""Hostile bodies under the size limit vs a running stream (issue 23, point 5).

A server (the engine, or a gateway in front of it) streams one reply; while it does, the
benchmark sends bodies under the 8 MiB limit that no context can hold, and measures the stream's
largest inter-token gap during them against its largest gap alone (the target: within 2x):

- ``long``: one 7.8 MB message;
- ``many``: 65,000 short messages, 7.8 MB in all;
- ``100x1MB``: 100 concurrent 1 MB bodies.

Each hostile reply's status and latency are recorded too (a 400 that names the length, soon).
The stream is read by a process of its own (the client sending the bodies must not stall the
reading), the hostile client is a process of its own too (``--sender-nice`` lowers its CPU
priority, as if it ran on another machine), and the machine's load average before and after goes
in the results. The stream runs until every hostile reply is in, so it covers the whole handling
(a hundred 1 MB bodies take seconds to judge), and each case is followed by the stream alone for
as long (the largest of more gaps is larger: the two compare only over equal spans); each case
runs ``--repeats`` times, and the ratio is of the medians.

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
from common import RESULTS_DIR, ServerProcess, load_average  # noqa: E402
from machine import describe_machine  # noqa: E402

STREAM_TOKENS = 20_000  # read until the case is over (the stream is closed then)
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
                  started: asyncio.Event, stop: Event) -> None:
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
                if stop.is_set():
                    return  # closing the stream aborts the request


def _reader(url: str, model: str, commands: Queue, arrivals_out: Queue, warm: Event, stop: Event) -> None:
    """The running stream, read by a process of its own: the hostile client's work (sending
    100 MB, reading replies) must not delay the reading and count as the server's stall. One
    stream per command, read until ``stop``. perf_counter is the system's monotonic clock, so
    the processes' times compare."""

    async def one() -> list[float]:
        arrivals: list[float] = []
        started = asyncio.Event()
        async with httpx.AsyncClient(timeout=600) as client:
            task = asyncio.create_task(_stream(client, url, model, arrivals, started, stop))
            done, _ = await asyncio.wait([task, asyncio.create_task(started.wait())],
                                         return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                task.result()  # the stream ended before it was warm: raise why
            warm.set()
            await task
        return arrivals

    while commands.get() is not None:
        arrivals_out.put(asyncio.run(one()))


def _sender(url: str, commands: Queue, replies_out: Queue, niceness: int) -> None:
    """The hostile client, a process of its own; ``niceness`` lowers its CPU priority (a client
    on another machine takes no CPU from the server)."""
    if niceness:
        os.nice(niceness)
    while (name := commands.get()) is not None:
        replies_out.put(asyncio.run(_send_all(url, SCENARIOS[name]())))


async def _hostile(client: httpx.AsyncClient, url: str, body: bytes) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    r = await client.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    msg = ""
    try:
        msg = r.json()["error"]["message"][:120]
    except (ValueError, KeyError, TypeError):
        pass
    return r.status_code, time.perf_counter() - t0, msg


def _gaps(arrivals: list[float], t0: float, t1: float) -> list[tuple[float, float]]:
    """Gaps (after the warm-up) that overlap [t0, t1], each with when it began after t0."""
    out = []
    for a, b in zip(arrivals[WARM_TOKENS // 2:], arrivals[WARM_TOKENS // 2 + 1:], strict=False):
        if b >= t0 and a <= t1:
            out.append((b - a, a - t0))
    return out


async def _send_all(url: str, bodies: list[bytes]) -> tuple[float, float, list[tuple[int, float, str]]]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=200)) as client:
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(_hostile(client, url, b) for b in bodies))
        return t0, time.perf_counter(), replies


class Measurer:
    """A stream reader process and a hostile sender process against one server."""

    def __init__(self, url: str, model: str, sender_nice: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.commands, self.arrivals, self.warm, self.stop = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
        self.send_commands, self.replies = ctx.Queue(), ctx.Queue()
        self.reader = ctx.Process(target=_reader, args=(url, model, self.commands, self.arrivals, self.warm,
                                                         self.stop))
        self.sender = ctx.Process(target=_sender, args=(url, self.send_commands, self.replies, sender_nice))
        self.reader.start()
        self.sender.start()

    def _stream(self, during) -> tuple[list[float], object]:
        self.warm.clear()
        self.stop.clear()
        self.commands.put("go")
        if not self.warm.wait(120):
            raise RuntimeError("the stream did not start")
        try:
            out = during()
        finally:
            self.stop.set()
        return self.arrivals.get(timeout=120), out

    def _result(self, arrivals: list[float], t0: float, t1: float) -> dict:
        timed = sorted(_gaps(arrivals, t0, t1))
        gaps = [g for g, _ in timed]
        return {"max_gap_ms": 1e3 * gaps[-1], "p99_gap_ms": 1e3 * gaps[int(0.99 * (len(gaps) - 1))],
                "median_gap_ms": 1e3 * statistics.median(gaps), "gaps": len(gaps), "window_s": t1 - t0,
                "window_t0": t0,  # perf_counter (CLOCK_MONOTONIC): lines up with `perf record -k CLOCK_MONOTONIC`
                # where the largest gaps fell (s after the window opened): intake, or judging
                "largest_gaps_at_s": [[round(1e3 * g, 1), round(at, 2)] for g, at in reversed(timed[-5:])]}

    def hostile(self, name: str) -> dict:
        def send() -> tuple:
            self.send_commands.put(name)
            return self.replies.get(timeout=600)

        arrivals, (t0, t1, replies) = self._stream(send)
        out = self._result(arrivals, t0, t1)
        out.update(statuses=sorted({s for s, _, _ in replies}), reply_s_max=max(d for _, d, _ in replies),
                   message=replies[0][2])
        return out

    def alone(self, seconds: float) -> dict:
        span: list[float] = []

        def wait() -> None:
            span.append(time.perf_counter())
            time.sleep(seconds)
            span.append(time.perf_counter())

        arrivals, _ = self._stream(wait)
        return self._result(arrivals, span[0], span[1])

    def close(self) -> None:
        self.commands.put(None)
        self.send_commands.put(None)
        for proc in (self.reader, self.sender):
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def run_target(url: str, model: str, label: str, repeats: int, sender_nice: int,
               cases: tuple[str, ...] = tuple(SCENARIOS)) -> dict:
    """Each case ``repeats`` times, each hostile run followed by a run of the stream alone for as
    long as the hostile window lasted (the largest of more gaps is larger: the two compare only
    over equal spans); the ratio is of the medians over the repeats."""
    m = Measurer(url, model, sender_nice)
    try:
        m.alone(1.0)  # warm the server and the clients
        runs: dict[str, list[tuple[dict, dict]]] = {name: [] for name in cases}
        for _ in range(repeats):
            for name in cases:
                hostile = m.hostile(name)
                runs[name].append((hostile, m.alone(hostile["window_s"])))
    finally:
        m.close()
    results: dict = {}
    print(f"{label}: largest inter-token gap of a running stream while hostile bodies are handled,"
          f" vs alone over as long; median of {repeats} runs")
    for name, pairs in runs.items():
        hostile_max = statistics.median(h["max_gap_ms"] for h, _ in pairs)
        alone_max = statistics.median(a["max_gap_ms"] for _, a in pairs)
        r = results[name] = {
            "max_gap_ms": hostile_max, "alone_max_gap_ms": alone_max, "vs_alone": hostile_max / alone_max,
            "runs": [{"hostile": h, "alone": a} for h, a in pairs],
            "statuses": sorted({s for h, _ in pairs for s in h["statuses"]}),
            "reply_s_max": max(h["reply_s_max"] for h, _ in pairs), "message": pairs[0][0]["message"]}
        each = ", ".join(f"{h['max_gap_ms']:.0f}/{a['max_gap_ms']:.0f}" for h, a in pairs)
        at = ", ".join(f"{h['largest_gaps_at_s'][0][1]:.1f}" for h, _ in pairs)
        print(f"  {name:>8}: {hostile_max:7.1f} ms vs {alone_max:5.1f} ms alone ({r['vs_alone']:.2f}x;"
              f" each run hostile/alone ms: {each}, the hostile one at +{at} s of the window; median gap"
              f" {statistics.median(h['median_gap_ms'] for h, _ in pairs):.1f} ms),"
              f" replies {r['statuses']} in <= {r['reply_s_max']:.2f} s: {r['message'][:60]}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--via", default="engine,gateway")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each case (the median is reported)")
    ap.add_argument("--sender-nice", type=int, default=0,
                    help="niceness of the hostile client's process (10: as if on another machine)")
    ap.add_argument("--cases", default=",".join(SCENARIOS), help="which cases, comma-separated")
    ap.add_argument("--out", default="", help="results file name under benchmarks/results")
    args = ap.parse_args()
    cases = tuple(c.strip() for c in args.cases.split(","))
    if unknown := set(cases) - set(SCENARIOS):
        ap.error(f"unknown cases {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    model_dir = resolve_model(args.model)
    spec = BACKENDS["ours"].launch(model_dir, 8970, args.threads, 256 << 20, 32768)
    logs = RESULTS_DIR / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out: dict = {"model": args.model, "threads": args.threads, "repeats": args.repeats,
                 "sender_nice": args.sender_nice, "cases": list(cases),
                 "machine": describe_machine(args.threads), "load_average_before": load_average()}
    with ServerProcess("engine", spec.argv, 8970, spec.env, logs / "hostile_engine.log") as engine:
        engine.wait_healthy()
        via = [v.strip() for v in args.via.split(",")]
        if "engine" in via:
            out["engine"] = run_target(engine.base_url, spec.request_model, "engine", args.repeats,
                                       args.sender_nice, cases)
        if "gateway" in via:
            argv = [sys.executable, "-m", "chatfleet.cli.main", "gateway", "--replica", engine.base_url,
                    "--port", "8971", "--log-level", "warning"]
            with ServerProcess("gateway", argv, 8971, {}, logs / "hostile_gateway.log") as gw:
                gw.wait_healthy()
                out["gateway"] = run_target(gw.base_url, spec.request_model, "gateway", args.repeats,
                                            args.sender_nice, cases)
    out["load_average_after"] = load_average()
    print(f"load average before {out['load_average_before']}, after {out['load_average_after']}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / (args.out or "hostile_bodies.json")).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
