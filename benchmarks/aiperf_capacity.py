"""Capacity at one device KV budget as an outside client sees it: AIPerf's multi-turn mode.

The same comparison as ``capacity.py`` (ours with every technique against vLLM's CPU build, same
device KV budget, dtype pinned: float32 unless ``--dtype bfloat16``, one thread each), driven by
AIPerf 0.13 instead of the project's own load generator:

1. A multi-turn dataset in AIPerf's ``multi_turn`` JSONL format, written from the project's own
   role-play workload (``chatfleet.bench.workload``: the long-session profile's personas with
   their long system prompts, 6-14 turns per chat, forced reply lengths, the pause between turns
   raised to a mean of 8 s as ``capacity.py --pause-mean 8`` does). One file per point; each
   conversation's persona card is a leading ``system`` turn (AIPerf sends it first in every
   request), each user turn carries its pause as ``delay`` (ms), its reply length as
   ``output_length`` and ``min_tokens``/``ignore_eos`` so every server writes exactly that many.
2. Before the sweep, a loopback check: AIPerf is run against a recording server on a 3-turn chat
   and every request must carry the system prompt, all earlier user turns and the recorder's own
   earlier replies, in order, under one ``X-Session-ID`` (AIPerf's default context mode,
   ``deltas_without_responses``, threads live replies into the history; this proves it here).
3. Per server and per user count, ``aiperf profile`` (chat endpoint, streaming, the model's own
   tokenizer.json, ``--concurrency`` = simultaneous users, a fixed window). AIPerf holds a
   concurrency slot per conversation through its pauses, so the concurrency is the number of live
   chats; a finished chat is replaced by the next from the file, from its first turn.
4. Each point's ``profile_export_aiperf.json`` is judged against the SLO (the same string as
   capacity.py: ``ttft_p95<=2s,itl_p95<=500ms``; AIPerf's ITL is each request's mean gap, its p95
   is over requests). A point with request errors fails. The knee is the largest passing user
   count before the first failure; the table gives it per server and the ratio ours / vLLM.

    python benchmarks/aiperf_capacity.py
    python benchmarks/aiperf_capacity.py --users 8,14,20,28 --duration 75 --series all,vllm,stock

Chats start at their first turn (AIPerf cannot join a conversation mid-way with live history), so
a window's histories are shorter than capacity.py's steady join; the start of the window is
spread over ``--ramp`` seconds rather than one burst of first turns. Writes
benchmarks/results/aiperf-capacity-<time>.json (CPU model and flags, load at start and end,
versions, every point's exact aiperf argv) and keeps each point's AIPerf artifacts beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chatfleet.bench.demo import kv_budget_bytes  # noqa: E402
from chatfleet.bench.dists import with_mean  # noqa: E402
from chatfleet.bench.servers import VLLM_SERIES_KV_DTYPE, SeriesSpec, start_server  # noqa: E402
from chatfleet.bench.slo import SLO, parse_slo  # noqa: E402
from chatfleet.bench.techniques import TechniqueSettings, engine_args, series_techniques  # noqa: E402
from chatfleet.bench.workload import Conversation, Workload, get_profile  # noqa: E402
from machine import describe_machine, load_average  # noqa: E402  (same folder)

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
AIPERF = BENCH_DIR / ".venv-aiperf" / "bin" / "aiperf"
SERIES = ("all", "vllm", "stock", "all_fp8", "vllm_fp8")  # the FP8 pair: capacity.py's, FP8 KV caches
SESSION_HEADER = "X-Session-ID"
# The SLO's metrics as AIPerf's summary names them (all in ms there).
AIPERF_METRIC = {"ttft": "time_to_first_token", "itl": "inter_token_latency", "reply": "request_latency"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--series", default="all,vllm", help=f"Comma-separated, from {', '.join(SERIES)}.")
    p.add_argument("--users", default="8,14,20,28", help="Simultaneous users per point, rising.")
    p.add_argument("--duration", type=float, default=75.0, help="Seconds AIPerf issues requests per point.")
    p.add_argument("--grace", type=float, default=30.0, help="Seconds to wait for in-flight replies after it.")
    p.add_argument("--ramp", type=float, default=10.0, help="Seconds over which the users join (0: at once).")
    p.add_argument("--min-requests", type=int, default=60, help="A point with fewer is marked thin.")
    p.add_argument("--conversations-per-user", type=int, default=3, help="Dataset size per point, per user.")
    p.add_argument("--connection-reuse", default="never", choices=("never", "pooled", "sticky-user-sessions"),
                   help="AIPerf's --connection-reuse-strategy. never: a pause longer than the server's keep-alive "
                        "(uvicorn: 5 s) cannot race a request onto a connection the server is closing.")
    p.add_argument("--keep-going", action="store_true", help="Measure every point, not up to the first failure.")
    p.add_argument("--model", default="small")
    p.add_argument("--profile", default="long-session")
    p.add_argument("--pause-mean", type=float, default=8.0, help="Mean pause between turns, seconds.")
    p.add_argument("--slo", default="ttft_p95<=2s,itl_p95<=500ms")
    p.add_argument("--kv-cache-tokens", type=int, default=6144, help="Device KV budget.")
    p.add_argument("--threads", type=int, default=1, help="Threads per server.")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="Pinned for every server, vLLM's included (bfloat16 where the CPU has it natively).")
    p.add_argument("--max-running", type=int, default=16, help="The `all` series' cap (as capacity.py).")
    p.add_argument("--host-cache-memory", default="1GiB", help="The `all` series' host tier (as capacity.py).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--aiperf", type=Path, default=AIPERF)
    p.add_argument("--vllm-python", type=Path, default=None)
    p.add_argument("--skip-history-check", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


# -- the dataset --------------------------------------------------------------------------------

def fitting_turns(conv: Conversation) -> int:
    """Turns kept so the last request's whole history fits the profile's prompt cap (AIPerf
    resends everything; the project's client would drop the oldest turns instead)."""
    n = 1
    while n < len(conv.turns) and conv.prompt_tokens(n) <= conv.max_prompt_tokens:
        n += 1
    return n


def conversation_record(conv: Conversation, session_id: str) -> dict:
    """One chat as an AIPerf ``multi_turn`` record: the persona card, then each user turn."""
    turns: list[dict] = [{"role": "system", "text": conv.system}]
    for i, t in enumerate(conv.turns[:fitting_turns(conv)]):
        turn: dict = {"text": t.user, "output_length": t.reply_tokens,
                      "extra": {"min_tokens": t.reply_tokens, "ignore_eos": True}}
        if i > 0:
            turn["delay"] = round(t.think_time_s * 1000.0, 1)  # ms after the previous reply
        turns.append(turn)
    return {"session_id": session_id, "turns": turns}


@dataclass(frozen=True)
class DatasetStats:
    path: str
    conversations: int
    turns: int
    mean_card_tokens: float
    mean_pause_s: float
    live_kv_tokens_est: int  # the first `users` chats' distinct cards plus their histories, mid-window


def write_dataset(path: Path, workload: Workload, users: int, conversations: int, first: int,
                  window_s: float, pause_mean_s: float) -> DatasetStats:
    """``conversations`` chats (indices from ``first``) as AIPerf multi_turn JSONL."""
    convs = [workload.conversation(first + i) for i in range(conversations)]
    records = [conversation_record(c, f"chat-{first + i}") for i, c in enumerate(convs)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    pauses = [t.think_time_s for c in convs for t in c.turns[1:fitting_turns(c)]]
    # KV the live chats want halfway through the window: one copy of each distinct card, each
    # chat's history up to the turn it has reached (a turn takes about a pause plus a second).
    turn_reached = max(1, int(window_s / 2 / (pause_mean_s + 1.0)))
    live = convs[:users]
    cards = {c.character_id: c.system_tokens for c in live}
    history = sum(c.prompt_tokens(min(turn_reached, fitting_turns(c) - 1)) - c.system_tokens for c in live)
    return DatasetStats(str(path), len(records), sum(len(r["turns"]) - 1 for r in records),
                        round(sum(c.system_tokens for c in convs) / len(convs), 1),
                        round(sum(pauses) / max(1, len(pauses)), 2), sum(cards.values()) + history)


# -- does AIPerf resend the history? --------------------------------------------------------------

class _Recorder(BaseHTTPRequestHandler):
    """A streaming chat server that records each request and replies with numbered words."""

    protocol_version = "HTTP/1.1"
    seen: list[dict] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # AIPerf's readiness probe: /v1/models
        self._send(200, "application/json", json.dumps({"object": "list", "data": [{"id": "bench"}]}).encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        n = len(self.seen)
        type(self).seen.append({"session": self.headers.get(SESSION_HEADER), "messages": body.get("messages")})
        words = [f" reply{n}w{i}" for i in range(int(body.get("max_completion_tokens") or body.get("max_tokens") or 3))]
        chunks = [{"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]} for w in words]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": len(words),
                                                "total_tokens": 1 + len(words)}})
        data = "".join(f"data: {json.dumps({'id': 'r', 'object': 'chat.completion.chunk', 'model': 'bench', **c})}\n\n"
                       for c in chunks) + "data: [DONE]\n\n"
        self._send(200, "text/event-stream", data.encode())

    def _send(self, status: int, ctype: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def check_history_resend(aiperf: Path, tokenizer: Path, work: Path) -> dict:
    """Run AIPerf on one 3-turn chat against a recorder; every turn must carry the whole history
    (system, earlier user turns, the recorder's own earlier replies) under one session id."""
    work.mkdir(parents=True, exist_ok=True)
    user = ["first question", "second question", "third question"]
    record = {"session_id": "probe", "turns": [{"role": "system", "text": "You are the probe persona."}]
              + [{"text": u, "output_length": 3, **({"delay": 200} if i else {})} for i, u in enumerate(user)]}
    (work / "probe.jsonl").write_text(json.dumps(record) + "\n")
    _Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    argv = [str(aiperf), "profile", "--model", "bench", "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", str(tokenizer), "--input-file", str(work / "probe.jsonl"),
            "--custom-dataset-type", "multi_turn", "--concurrency", "1", "--request-count", "3",
            "--session-header", SESSION_HEADER, "--use-server-token-count", "--ui", "none",
            "--no-server-metrics", "--no-gpu-telemetry", "--artifact-dir", str(work / "aiperf")]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
    seen = list(_Recorder.seen)
    problems = [] if proc.returncode == 0 else [f"aiperf exited {proc.returncode}: {proc.stdout[-500:]}"]
    if len(seen) != 3:
        problems.append(f"{len(seen)} requests recorded, want 3")
    for k, req in enumerate(seen[:3]):
        want: list[tuple[str, str]] = [("system", "You are the probe persona.")]
        for j in range(k):
            want += [("user", user[j]), ("assistant", "".join(f" reply{j}w{i}" for i in range(3)))]
        want.append(("user", user[k]))
        got = [(m.get("role"), m.get("content") if isinstance(m.get("content"), str)
                else "".join(p.get("text", "") for p in m.get("content") or [])) for m in req["messages"] or []]
        if got != want:
            problems.append(f"turn {k} sent {got}, want {want}")
    sessions = {r["session"] for r in seen}
    if len(sessions) != 1 or None in sessions:
        problems.append(f"session header {SESSION_HEADER} values {sorted(map(str, sessions))}, want one")
    return {"ok": not problems, "problems": problems, "requests": seen, "argv": argv}


# -- one point ----------------------------------------------------------------------------------

@dataclass
class Point:
    users: int
    argv: list[str]
    dataset: DatasetStats
    wall_s: float = 0.0
    returncode: int | None = None
    requests: int = 0
    error_rate_pct: float = 0.0
    values_ms: dict[str, float] = field(default_factory=dict)  # 'ttft_p95' -> ms, per SLO target
    ttft_p50_ms: float | None = None
    output_tok_s: float | None = None
    request_s: float | None = None
    cache_metrics: dict[str, float] = field(default_factory=dict)
    passed: bool = False
    reasons: list[str] = field(default_factory=list)
    thin: bool = False
    load_average: list[float] = field(default_factory=list)
    client_cpu_s: float | None = None  # AIPerf's own CPU time (all its processes) for the point


def aiperf_argv(args: argparse.Namespace, url: str, model: str, tokenizer: Path, dataset: Path,
                users: int, artifacts: Path) -> list[str]:
    argv = [str(args.aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", str(tokenizer), "--input-file", str(dataset), "--custom-dataset-type", "multi_turn",
            "--concurrency", str(users), "--benchmark-duration", f"{args.duration:g}",
            "--benchmark-grace-period", f"{args.grace:g}", "--session-header", SESSION_HEADER,
            "--use-server-token-count", "--extra-inputs", "temperature:1.0", "--random-seed", str(args.seed),
            "--request-timeout-seconds", "300", "--connection-reuse-strategy", args.connection_reuse,
            "--workers-max", "1", "--record-processor-service-count", "1",
            "--no-server-metrics", "--no-gpu-telemetry", "--ui", "none", "--artifact-dir", str(artifacts)]
    if args.ramp > 0 and users > 1:
        argv += ["--concurrency-ramp-duration", f"{args.ramp:g}"]
    return argv


def _stat_ms(summary: dict, metric: str, stat: str) -> float:
    entry = summary.get(AIPERF_METRIC[metric]) or {}
    value = entry.get("avg" if stat == "mean" else stat)
    return float("nan") if value is None else float(value)


def judge(point: Point, summary: dict, slo: SLO, min_requests: int) -> Point:
    """Fill ``point`` from AIPerf's summary export and decide it against ``slo``."""
    point.requests = int((summary.get("request_count") or {}).get("avg") or 0)
    point.error_rate_pct = float((summary.get("request_error_rate") or {}).get("avg") or 0.0)
    point.ttft_p50_ms = (summary.get("time_to_first_token") or {}).get("p50")
    point.output_tok_s = (summary.get("output_token_throughput") or {}).get("avg")
    point.request_s = (summary.get("request_throughput") or {}).get("avg")
    point.cache_metrics = {k: v.get("avg") for k, v in summary.items()
                           if "cache" in k and isinstance(v, dict) and v.get("avg") is not None}
    point.reasons = []
    for t in slo.targets:
        if t.metric not in AIPERF_METRIC:
            point.reasons.append(f"{t.key}: AIPerf does not report it")
            continue
        ms = _stat_ms(summary, t.metric, t.stat)
        point.values_ms[t.key] = ms
        if not t.ok(ms / 1000.0):
            point.reasons.append(f"{t.key} {ms:.0f} ms > {t.threshold_s * 1000:g} ms")
    if point.requests == 0:
        point.reasons.append("no requests completed")
    if point.error_rate_pct > 0:
        point.reasons.append(f"{point.error_rate_pct:.1f}% of requests failed")
    point.thin = point.requests < min_requests
    point.passed = not point.reasons
    return point


def run_point(args: argparse.Namespace, url: str, model: str, tokenizer: Path, workload: Workload,
              users: int, point_dir: Path, first: int, slo: SLO) -> Point:
    point_dir.mkdir(parents=True, exist_ok=True)
    stats = write_dataset(point_dir / "dataset.jsonl", workload, users, users * args.conversations_per_user, first,
                          args.duration, args.pause_mean)
    argv = aiperf_argv(args, url, model, tokenizer, Path(stats.path), users, point_dir / "aiperf")
    point = Point(users, argv, stats)
    t0 = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(point_dir / "aiperf.log", "w") as log:
        try:
            point.returncode = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                                              timeout=args.duration + args.grace + 240).returncode
        except subprocess.TimeoutExpired:
            point.returncode = None
    point.wall_s = round(time.monotonic() - t0, 1)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    point.client_cpu_s = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1)
    point.load_average = load_average()
    export = point_dir / "aiperf" / "profile_export_aiperf.json"
    if not export.exists():
        point.reasons = [f"aiperf wrote no summary (exit {point.returncode}); see {point_dir / 'aiperf.log'}"]
        return point
    return judge(point, json.loads(export.read_text()), slo, args.min_requests)


def knee(points: list[Point]) -> int | None:
    """The largest passing user count before the first failing one."""
    best = None
    for p in sorted(points, key=lambda p: p.users):
        if not p.passed:
            break
        best = p.users
    return best


def reset_prefix_cache(url: str) -> str:
    """Each point starts from an empty prefix cache (ours and vLLM both take POST /reset_prefix_cache)."""
    try:
        return str(httpx.post(url + "/reset_prefix_cache", timeout=60.0).status_code)
    except httpx.HTTPError as e:
        return f"failed: {e!r}"


# -- the sweep ----------------------------------------------------------------------------------

def series_spec(name: str, args: argparse.Namespace, model_dir: Path) -> SeriesSpec:
    budget = kv_budget_bytes(model_dir, args.kv_cache_tokens, args.dtype)
    if name in VLLM_SERIES_KV_DTYPE:
        return SeriesSpec.vllm(name, model_dir, budget, args.kv_cache_tokens, args.threads, args.vllm_python,
                               dtype=args.dtype, kv_cache_dtype=VLLM_SERIES_KV_DTYPE[name])
    base = ("--kv-cache-memory", str(budget), "--dtype", args.dtype)  # bytes: FP8 holds twice the tokens
    settings = TechniqueSettings(max_running=args.max_running, host_cache_memory=args.host_cache_memory)
    return SeriesSpec.chatfleet(name, args.model, engine_args(series_techniques(name), settings, base),
                                args.threads)


def sweep(spec: SeriesSpec, args: argparse.Namespace, levels: list[int], model_dir: Path, workload: Workload,
          run_dir: Path, slo: SLO, con: Console) -> dict:
    points: list[Point] = []
    resets = []
    t0 = time.monotonic()
    with start_server(spec, run_dir) as url:
        started_s = round(time.monotonic() - t0, 1)
        for k, users in enumerate(levels):
            resets.append(reset_prefix_cache(url))
            p = run_point(args, url, spec.request_model, model_dir, workload, users,
                          run_dir / f"{spec.name}-u{users}", 100_000 * (k + 1), slo)
            points.append(p)
            vals = ", ".join(f"{key} {v:.0f} ms" for key, v in p.values_ms.items())
            con.print(f"  {spec.name} {users} users: {'pass' if p.passed else 'FAIL'} ({p.requests} requests, "
                      f"{vals}; {p.wall_s:.0f} s, AIPerf CPU {p.client_cpu_s} s, "
                      f"load {p.load_average[0] if p.load_average else '?'})"
                      + (f" [{'; '.join(p.reasons)}]" if p.reasons else ""))
            if not p.passed and not args.keep_going:
                break
    return {"series": spec.name, "server": spec.describe(), "startup_s": started_s, "prefix_cache_resets": resets,
            "knee": knee(points), "points": [asdict(p) for p in points]}


def versions(args: argparse.Namespace) -> dict:
    from importlib.metadata import version

    def run_quiet(cmd: list[str]) -> str | None:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            return out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    vllm_py = args.vllm_python or BENCH_DIR / ".venv-vllm" / "bin" / "python"
    return {"chatfleet": version("chatfleet"),
            "git_commit": run_quiet(["git", "-C", str(BENCH_DIR), "rev-parse", "HEAD"]),
            "aiperf": run_quiet([str(args.aiperf.parent / "python"), "-c",
                                 "import importlib.metadata as m; print(m.version('aiperf'))"]),
            "vllm": run_quiet([str(vllm_py), "-c", "import vllm; print(vllm.__version__)"]),
            "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    con = Console(width=120)
    from chatfleet.bench.tokens import load_counter
    from chatfleet.engine.builtin_models.tiny import resolve_model

    names = [s.strip() for s in args.series.split(",") if s.strip()]
    unknown = [s for s in names if s not in SERIES]
    if unknown:
        raise SystemExit(f"unknown series {unknown}; valid: {', '.join(SERIES)}")
    levels = sorted({int(u) for u in args.users.split(",") if u.strip()})
    if not args.aiperf.exists():
        raise SystemExit(f"AIPerf is not installed at {args.aiperf} (bash benchmarks/setup_baselines.sh aiperf)")
    slo = parse_slo(args.slo)
    model_dir = Path(resolve_model(args.model))
    profile = get_profile(args.profile)
    if args.pause_mean > 0:
        profile = profile.with_overrides(think_time_s=with_mean(profile.think_time_s, args.pause_mean))
    workload = Workload(profile, args.seed, load_counter(args.model))
    run_dir = RESULTS_DIR / time.strftime("aiperf-capacity-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    machine = describe_machine(args.threads)
    load_start = load_average()
    con.print(f"{machine['cpu_model']} ({', '.join(f for f, on in machine['flags'].items() if on)}), load "
              f"{load_start}; KV budget {kv_budget_bytes(model_dir, args.kv_cache_tokens, args.dtype) / 2**20:.1f} MiB "
              f"({args.kv_cache_tokens:,} tokens of {args.dtype}; an FP8 cache holds twice that), "
              f"{args.threads} thread(s); "
              f"{args.profile} (mean pause {args.pause_mean:g} s); SLO {slo}; users {levels}, {args.duration:g} s each")
    history = None
    if not args.skip_history_check:
        history = check_history_resend(args.aiperf, model_dir, run_dir / "history-check")
        con.print(f"AIPerf resends the whole history: {'yes' if history['ok'] else 'NO'}"
                  + ("" if history["ok"] else f" ({'; '.join(history['problems'])[:800]})"))
        if not history["ok"]:
            raise SystemExit("AIPerf does not send the conversation history; the comparison would not be multi-turn")
    results, failed = {}, {}
    for name in names:
        try:
            spec = series_spec(name, args, model_dir)
            results[name] = sweep(spec, args, levels, model_dir, workload, run_dir, slo, con)
        except Exception as e:  # a server that does not start is reported, the others still run
            failed[name] = f"{type(e).__name__}: {e}"[:2000]
            con.print(f"[red]{name} failed:[/] {failed[name][:500]}")
    load_end = load_average()
    ratios = {f"{n} / {ref}": results[n]["knee"] / results[ref]["knee"] for ref in ("vllm", "vllm_fp8")
              for n in results if not n.startswith("vllm") and ref in results
              and results[n]["knee"] and results[ref]["knee"]}
    _print(con, results, ratios, slo)
    doc = {"benchmark": "aiperf_capacity", "created_unix": time.time(), "argv": sys.argv[1:],
           "settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                        "kv_budget_bytes": kv_budget_bytes(model_dir, args.kv_cache_tokens, args.dtype),
                        "levels": levels, "profile": args.profile, "dtype": args.dtype},
           "machine": machine, "load_average_start": load_start, "load_average_end": load_end,
           "versions": versions(args), "history_check": history, "failed": failed, "series": results,
           "knees": {n: r["knee"] for n, r in results.items()}, "knee_ratios": ratios}
    out = args.out or RESULTS_DIR / f"{run_dir.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    con.print(f"load average start {load_start}, end {load_end}; wrote {out}")
    return 0


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.0f}"


def _print(con: Console, results: dict, ratios: dict, slo: SLO) -> None:
    t = Table(title=f"AIPerf multi-turn capacity, SLO {slo}")
    keys = [tg.key for tg in slo.targets]
    for c in ("series", "users", "requests", *(f"{k} ms" for k in keys), "out tok/s", "cached", "verdict"):
        t.add_column(c, justify="right")
    for name, r in results.items():
        for p in r["points"]:
            verdict = ("pass" if p["passed"] else "fail") + (" (thin)" if p["thin"] else "")
            cached = p["cache_metrics"].get("overall_usage_prompt_cache_read_pct")  # server-reported hits
            t.add_row(name, str(p["users"]), str(p["requests"]), *(_fmt_ms(p["values_ms"].get(k)) for k in keys),
                      "-" if p["output_tok_s"] is None else f"{p['output_tok_s']:.1f}",
                      "-" if cached is None else f"{cached:.0f}%", verdict)
    con.print(t)
    for name, r in results.items():
        con.print(f"knee {name}: {r['knee'] if r['knee'] is not None else 'none'}")
    for name, v in ratios.items():
        con.print(f"knee ratio {name}: {v:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
