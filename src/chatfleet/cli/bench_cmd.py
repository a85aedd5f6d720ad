"""`chatfleet bench` (one load point), `sweep` (find the knee), `fleet` (size from a sweep),
`workload` (profile statistics and trace export). Each works against any OpenAI-compatible URL."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console

from chatfleet.bench import console as ui
from chatfleet.bench.client import ClientConfig
from chatfleet.bench.fleet import FleetPlan, plan_fleet
from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.report import load_result, result_document, sweep_to_dict, write_html, write_json
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.sources import WorkloadSource, discover_model, run_async
from chatfleet.bench.sweep import Bench, RunProtocol, SweepSpec, sweep
from chatfleet.bench.transport import Endpoint
from chatfleet.bench.workload import PROFILES, get_profile
from chatfleet.cli.errors import check_reachable, fail
from chatfleet.errors import ChatfleetError, ConfigError

_L = LoadSpec("closed", 1)
_P = RunProtocol("http://127.0.0.1:8000", _L, parse_slo("ttft_p99<=1s"))
out = Console()
err = Console(stderr=True)

O_URL = typer.Option(..., "--url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")
O_MODEL = typer.Option(None, "--model", help="Model name to send (default: the first on /v1/models).")
O_PROFILE = typer.Option("cpu-roleplay", "--profile", help=f"Workload profile: {', '.join(PROFILES)}.")
O_TOKENIZER = typer.Option(None, "--tokenizer", help="Calibrate lengths with this tokenizer: model folder, "
                           "tokenizer.json, 'tiny' or 'small' (default: a byte estimate).")
O_SLO = typer.Option("ttft_p99<=1s,itl_p99<=100ms", "--slo", help="Targets, e.g. 'reply_p50<=3.8s,reply_p95<=7s'.")
O_MODE = typer.Option(_L.mode, "--mode", help="closed (live chats), open (new chats/s) or concurrency.")
O_DURATION = typer.Option(_L.duration_s, "--duration", help="Measured seconds per run.")
O_WARMUP = typer.Option(_L.warmup_s, "--warmup", help="Warmup seconds per run (excluded).")
O_REPEATS = typer.Option(_P.repeats, "--repeats", help="Runs per load point (confidence intervals).")
O_SEED = typer.Option(0, "--seed", help="Base seed; every run gets a new one derived from it.")
O_KIND = typer.Option(_P.server_kind, "--server-kind", help="chatfleet, vllm, sglang or none (cache reset).")
O_NOVERIFY = typer.Option(False, "--no-verify-reset", help="Reset the prefix cache without verifying it.")
O_FLOOR = typer.Option(None, "--clock-floor",
                       help="Set aside runs whose clock fell below this (MHz, or a fraction <= 1 of max).")
O_TRANSPORT = typer.Option(_P.transport, "--transport", help="raw (asyncio, default) or httpx.")
O_TRACE = typer.Option(None, "--trace", help="Replay an OpenAI-messages JSONL trace.")
O_SHAREGPT = typer.Option(None, "--sharegpt", help="Replay ShareGPT JSON conversations.")
O_HISTORY = typer.Option(_L.history, "--history", help="live (server replies) or trace (scripted replies) in history.")
O_OUT = typer.Option(None, "--out", help="Write the JSON result here.")
O_HTML = typer.Option(None, "--html", help="Write the HTML report here.")
O_TEMP = typer.Option(1.0, "--temperature", help="Sampling temperature sent with requests.")
O_TIMEOUT = typer.Option(300.0, "--request-timeout", help="Seconds before a request counts as timed out.")
O_MAXREQ = typer.Option(None, "--max-requests", help="Stop sending after this many requests per run.")
O_KEY = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="Bearer token for the server.")
O_CONF = typer.Option(0.95, "--confidence", help="Judge a point by intervals at this level over its requests "
                      "(met, broken or undecided; undecided is measured again); 0: by the estimate alone.")
O_EXTEND = typer.Option(3, "--extend-up-to", help="An undecided point runs up to this many times --repeats.")


def _fail(e: Exception) -> None:
    fail(e.message if isinstance(e, ChatfleetError) else str(e))


def _protocol(url, mode, duration, warmup, repeats, seed, kind, no_verify, floor, transport, history, slo, max_req,
              level=1.0, api_key=None, confidence=0.95, extend_up_to=3):
    load = LoadSpec(mode, level, duration_s=duration, warmup_s=warmup, history=history, max_requests=max_req)
    if confidence < 0 or confidence >= 1:
        raise ConfigError(f"--confidence must be in [0, 1) (0: judge by the estimate alone), got {confidence:g}")
    return RunProtocol(url, load, parse_slo(slo), repeats=repeats, base_seed=seed, server_kind=kind,
                       verify_reset=not no_verify, clock_floor=floor, transport=transport, api_key=api_key,
                       confidence=confidence or None, extend_up_to=extend_up_to)


def _with_bench(proto: RunProtocol, client: ClientConfig, make, action):
    """Run ``await action(bench)`` with a progress-reporting Bench, closed afterwards."""

    async def go():
        b = Bench(proto, client, make, ui.ProgressObserver())
        try:
            return await action(b)
        finally:
            await b.close()

    return run_async(go())


def _settings(**kw) -> dict:
    """Every setting of the run for the JSON result; secrets are redacted."""
    out = {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in kw.items()}
    for v in out.values():
        if isinstance(v, dict) and v.get("api_key"):
            v["api_key"] = "(redacted)"
    argv = sys.argv[1:]
    argv = ["(redacted)" if i > 0 and argv[i - 1] == "--api-key" else a for i, a in enumerate(argv)]
    return {"argv": argv, **out}


def bench(url: str = O_URL, level: float = typer.Option(8, "--level", help="Live chats (closed), new chats/s "
          "(open) or requests in flight (concurrency)."), model: str | None = O_MODEL, profile: str = O_PROFILE,
          tokenizer: str | None = O_TOKENIZER, slo: str = O_SLO, mode: str = O_MODE, duration: float = O_DURATION,
          warmup: float = O_WARMUP, repeats: int = O_REPEATS, seed: int = O_SEED, server_kind: str = O_KIND,
          no_verify_reset: bool = O_NOVERIFY, clock_floor: float | None = O_FLOOR, transport: str = O_TRANSPORT,
          trace: str | None = O_TRACE, sharegpt: str | None = O_SHAREGPT, history: str = O_HISTORY,
          temperature: float = O_TEMP, request_timeout: float = O_TIMEOUT, max_requests: int | None = O_MAXREQ,
          api_key: str | None = O_KEY, confidence: float = O_CONF, extend_up_to: int = O_EXTEND,
          out_path: Path | None = O_OUT, html: Path | None = O_HTML) -> None:
    """Measure one load point (repeated --repeats times) against URL."""
    try:
        proto = _protocol(url, mode, duration, warmup, repeats, seed, server_kind, no_verify_reset, clock_floor,
                          transport, history, slo, max_requests, level, api_key, confidence, extend_up_to)
        source = WorkloadSource(get_profile(profile), tokenizer, trace, sharegpt, history)
        make, counter = source.factory()
        Endpoint.parse(url)  # a clear error for a URL that is not http(s)://HOST:PORT
        check_reachable(url, proto.headers)
        client = ClientConfig(model or discover_model(url, api_key), temperature=temperature,
                              request_timeout_s=request_timeout)

        point = _with_bench(proto, client, make, lambda b: b.run_point(level))
    except ChatfleetError as e:
        _fail(e)
    for run in point.runs:
        out.print(ui.summary_table(run.summary, f"load {level:g} ({mode}), seed {run.seed}"))
        out.print(ui.run_facts(run.summary))
    for table in ui.breakdown_tables(point.breakdown(), f"load {level:g}, repeats pooled"):
        out.print(table)
    from chatfleet.bench.sweep import SweepResult

    res = SweepResult(mode, slo, [point], level if point.passed else None, not point.passed)
    out.print(f"SLO at load {level:g}: [bold]{ui.VERDICT_TEXT[point.verdict]}[/]")
    for note in ui.reset_notes(res):
        out.print(f"[yellow]note:[/] {note}", highlight=False)
    for line in ui.undecided_lines(res):
        out.print(line, highlight=False)
    doc = result_document("bench", _settings(url=url, model=client.model, profile=get_profile(profile),
                          tokenizer=counter.name, protocol=proto, client=client), {url: sweep_to_dict(res)})
    _write(doc, out_path, html)


def sweep_cmd(url: str = O_URL, start: float = typer.Option(2, "--start", help="First load level."),
              max_level: float = typer.Option(256, "--max", help="Highest load level to try."),
              growth: float = typer.Option(2.0, "--growth", help="Factor between levels until the SLO breaks."),
              resolution: float = typer.Option(1.0, "--resolution", help="Bisect until the bracket is this narrow."),
              max_points: int = typer.Option(12, "--max-points", help="Most load points to measure."),
              model: str | None = O_MODEL, profile: str = O_PROFILE, tokenizer: str | None = O_TOKENIZER,
              slo: str = O_SLO, mode: str = O_MODE, duration: float = O_DURATION, warmup: float = O_WARMUP,
              repeats: int = O_REPEATS, seed: int = O_SEED, server_kind: str = O_KIND,
              no_verify_reset: bool = O_NOVERIFY, clock_floor: float | None = O_FLOOR, transport: str = O_TRANSPORT,
              trace: str | None = O_TRACE, sharegpt: str | None = O_SHAREGPT, history: str = O_HISTORY,
              temperature: float = O_TEMP, request_timeout: float = O_TIMEOUT, max_requests: int | None = O_MAXREQ,
              api_key: str | None = O_KEY, confidence: float = O_CONF, extend_up_to: int = O_EXTEND,
              peak: int | None = typer.Option(None, "--peak", help="Also size a fleet for this many peak chats."),
              headroom: float = typer.Option(0.0, "--headroom", help="Fleet headroom above the peak (0.2 = 20%)."),
              price: float | None = typer.Option(None, "--price", help="Price per GPU-hour for the cost."),
              out_path: Path | None = O_OUT, html: Path | None = O_HTML) -> None:
    """Raise the load until the SLO breaks, then bisect: report the knee (and a fleet size)."""
    try:
        proto = _protocol(url, mode, duration, warmup, repeats, seed, server_kind, no_verify_reset, clock_floor,
                          transport, history, slo, max_requests, api_key=api_key, confidence=confidence,
                          extend_up_to=extend_up_to)
        spec = SweepSpec(start, max_level, growth, resolution, max_points)
        source = WorkloadSource(get_profile(profile), tokenizer, trace, sharegpt, history)
        make, counter = source.factory()
        Endpoint.parse(url)  # a clear error for a URL that is not http(s)://HOST:PORT
        check_reachable(url, proto.headers)
        client = ClientConfig(model or discover_model(url, api_key), temperature=temperature,
                              request_timeout_s=request_timeout)

        res = _with_bench(proto, client, make, lambda b: sweep(b, spec))
        fleet = plan_fleet(res.knee, peak, headroom, price) if peak and res.knee else None
    except ChatfleetError as e:
        _fail(e)
    out.print(ui.sweep_table(res, f"sweep against {url} ({mode}, SLO {res.slo})"))
    knee = "none" if res.knee is None else f"{res.knee:g}" + ("" if res.knee_reached else " (max reached)")
    out.print(f"knee: [bold]{knee}[/]")
    for note in ui.reset_notes(res):
        out.print(f"[yellow]note:[/] {note}", highlight=False)
    for line in ui.undecided_lines(res):
        out.print(line, highlight=False)
    shown = next((p for p in res.points if p.level == res.knee), res.points[-1] if res.points else None)
    if shown is not None:
        for table in ui.breakdown_tables(shown.breakdown(), f"load {shown.level:g}"):
            out.print(table)
    if fleet:
        out.print(ui.fleet_table({url: fleet}))
    doc = result_document("sweep", _settings(url=url, model=client.model, profile=get_profile(profile),
                          tokenizer=counter.name, protocol=proto, sweep=spec, client=client),
                          {url: sweep_to_dict(res)}, {"fleet": {url: fleet.to_dict()} if fleet else {}})
    _write(doc, out_path, html)


def fleet_cmd(result: Path = typer.Argument(..., help="JSON result of `chatfleet sweep` or `demo`."),
              peak: int = typer.Option(2200, "--peak", help="Peak concurrent chats to serve."),
              headroom: float = typer.Option(0.0, "--headroom", help="Provision this share above the peak."),
              price: float | None = typer.Option(None, "--price", help="Price per GPU-hour."),
              gpus_per_replica: int = typer.Option(1, "--gpus-per-replica", help="GPUs one replica uses."),
              series: str | None = typer.Option(None, "--series", help="Which series of the result (default: all)."),
              level: float | None = typer.Option(None, "--level", help="Chats one replica holds, for a result "
                                                 "without a measured knee (e.g. one `chatfleet bench` point)."),
              ) -> None:
    """Fleet size from a sweep: replicas = ceil(peak x (1 + headroom) / knee), and the cost."""
    try:
        doc = load_result(result)
        names = [series] if series else list(doc["series"])
        plans: dict[str, FleetPlan | None] = {}
        for n in names:
            if n not in doc["series"]:
                raise ChatfleetError(f"no series {n!r} in {result}; it has: {', '.join(doc['series'])}")
            plans[n] = plan_fleet(_knee_of(doc["series"][n], n, level), peak, headroom, price, gpus_per_replica)
    except ChatfleetError as e:
        _fail(e)
    out.print(ui.fleet_table(plans, f"fleet for {peak} peak chats"))


def _knee_of(series: dict, name: str, level: float | None) -> float:
    """The series' measured knee: a passing level with a failing one above it. Without one (a
    single `bench` point, or a sweep that never broke the SLO) only an explicit --level sizes."""
    if level is not None:
        if not level > 0:
            raise ConfigError(f"--level must be > 0, got {level:g}")
        return level
    knee, reached = series.get("knee"), series.get("knee_reached")
    if knee and reached:
        return knee
    if knee:
        why = f"its highest level, {knee:g}, still met the SLO, so the knee may lie higher"
    else:
        why = "no level met the SLO"
    raise ConfigError(f"series {name!r} has no measured knee ({why}); run `chatfleet sweep`, or give "
                      "--level N to size for N chats per replica")


def workload_cmd(profile: str = O_PROFILE, tokenizer: str | None = O_TOKENIZER, seed: int = O_SEED,
                 n: int = typer.Option(400, "--conversations", help="Conversations to sample."),
                 export: Path | None = typer.Option(None, "--export", help="Write them as OpenAI-messages JSONL."),
                 ) -> None:
    """Print a profile's statistics (calibrated with --tokenizer); optionally export a trace."""
    from chatfleet.bench.traces import export_jsonl
    from chatfleet.bench.workload_stats import describe

    try:
        src = WorkloadSource(get_profile(profile), tokenizer, history="trace" if export else "live")
        w = src.factory()[0](seed)
        out.print(ui.workload_table(describe(w, n=n)))
        if export:
            export_jsonl(w, n, export)
            out.print(f"wrote {n} conversations to {export}")
    except ChatfleetError as e:
        _fail(e)


def _write(doc: dict, out_path: Path | None, html: Path | None) -> None:
    if out_path:
        write_json(doc, out_path)
        out.print(f"result: {out_path}")
    if html:
        write_html(doc, html)
        out.print(f"report: {html}")


def register(app: typer.Typer) -> None:
    """Add `bench`, `sweep`, `fleet` and `workload` to `app`."""
    app.command("bench")(bench)
    app.command("sweep")(sweep_cmd)
    app.command("fleet")(fleet_cmd)
    app.command("workload")(workload_cmd)
