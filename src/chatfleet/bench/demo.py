"""`chatfleet demo`: the built-in engine stock vs tuned at one scarce device KV budget, swept
with long-session role-play chats; knees (with their spread over repeats) and fleet sizes.

Stock is the engine as it ships (prefix cache on, chunked prefill on, no cap, LRU eviction, FCFS,
no host tier). Tuned adds the warm-cache techniques (``bench/techniques.py``: a cap on running
requests, a host tier, session-aware eviction, longest-cached-prefix-first scheduling) at the
same device KV budget; a technique the installed engine does not accept yet is named in the
output, never silently dropped. ``--with-vllm`` adds vLLM's CPU build at the same budget and
dtype as a third series. Series run one after the other, each with the same threads, so none
steals another's cores (``parallel`` runs them at once: faster, but each slows the others).

Each load point is sized for the SLO's percentiles (``bench/point_sizing.py``): its first run lasts
``duration_s`` (enough to show a clearly broken point), and an undecided point runs on until each
target has the values its interval needs (72 for a p95 at 95%) and as many as would decide it,
at most ``max_point_s`` measured seconds a point and ``series_budget_s`` a series, so the whole
demo stays bounded in time. A point is met (or broken) only where its pooled intervals say so and no
run judged on its own requests says the opposite; where the runs disagree it is undecided and not
measured further (``bench/run_agreement.py``). The climb goes on past an undecided load until one
breaks the SLO.

The output names the CPU, each knee with its bracket (the highest load shown to meet the SLO ..
the lowest shown to break it, with any undecided loads between: ``knee.knee_bracket``) and the
tuned/stock ratio with the range the two brackets give (tuned's low end over stock's high end,
and the other way round), or says which verdict is missing and why. It watches the machine's CPU
time during each series (``machine.CpuWatch``) and says DISTURBED where other work at normal
priority took more than ``DISTURBED_SHARE`` of it (niced work is reported, not flagged): the range
covers the sampling noise of one machine state, not a change in what else the machine runs.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console

from chatfleet.bench import console as ui
from chatfleet.bench.client import ClientConfig
from chatfleet.bench.dists import with_mean
from chatfleet.bench.fleet import FleetPlan, plan_fleet
from chatfleet.bench.knee import KneeBracket, KneeRatio, bracket_ratio, knee_bracket, knee_spread
from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.machine import (
    DISTURBED_SHARE,
    CpuUse,
    CpuWatch,
    MachineInfo,
    code_version,
    describe_code,
    machine_info,
)
from chatfleet.bench.point_sizing import PointSizing, values_needed_for
from chatfleet.bench.report import result_document, sweep_to_dict, write_html, write_json
from chatfleet.bench.servers import SeriesSpec, start_server
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.sources import WorkloadSource, run_async
from chatfleet.bench.sweep import Bench, PointResult, RunProtocol, SweepResult, SweepSpec, sweep
from chatfleet.bench.techniques import TECHNIQUES, EngineArgs, TechniqueSettings, engine_args
from chatfleet.bench.workload import WorkloadProfile, get_profile
from chatfleet.errors import ConfigError


@dataclass(frozen=True)
class DemoConfig:
    model: str = "small"
    profile: str = "long-session"
    pause_mean_s: float | None = None  # the profile's mean pause between turns; None: as it ships
    join: str = "steady"  # closed-loop chats joined mid-conversation (bench/loops.JOINS) or from turn 0
    slo: str = "ttft_p95<=1s,itl_p95<=200ms"
    peak_chats: int = 2200
    headroom: float = 0.0
    price_per_gpu_hour: float | None = None
    threads: int = 2
    duration_s: float = 8.0  # a point's first run; an undecided point's later runs are sized
    warmup_s: float = 3.0
    max_run_s: float = 60.0  # the longest single sized run (the point is judged again after each)
    max_point_s: float = 240.0  # measured seconds one point may spend deciding (a p95 at 1 chat: ~200 s)
    series_budget_s: float = 330.0  # measured seconds one series' sweep may spend
    start: int = 4
    max_level: int = 64
    max_points: int = 6  # with the climb past an undecided load and the bisection of the gap above it
    growth: float = 2.0  # between load levels until the SLO breaks
    resolution: float = 1.0  # then bisect until the bracket is this narrow (chats)
    repeats: int = 2
    confidence: float | None = 0.95  # points judged by intervals (bench/point_verdict); None: by the estimate
    extend_up_to: int = 3  # an undecided point runs up to this many times its repeats
    seed: int = 0
    parallel: bool = False  # every series at once (threads each); default: one after the other
    kv_cache_tokens: int = 2048  # the device KV budget of every series: scarce, so memory binds
    techniques: TechniqueSettings = field(default_factory=TechniqueSettings)
    with_vllm: bool = False
    vllm_python: Path | None = None  # default: benchmarks/.venv-vllm of this checkout
    out_dir: Path = field(default_factory=lambda: Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))

    def __post_init__(self) -> None:
        parse_slo(self.slo)
        get_profile(self.profile)
        if self.threads < 1 or self.peak_chats < 1 or self.max_points < 2 or self.repeats < 1:
            raise ConfigError("threads, peak chats and repeats must be >= 1, max points >= 2")
        if self.confidence is not None and not 0 < self.confidence < 1:
            raise ConfigError(f"--confidence must be in [0, 1) (0: by the estimate alone), got {self.confidence:g}")
        if self.extend_up_to < 1:
            raise ConfigError(f"--extend-up-to must be >= 1 (1: never extend), got {self.extend_up_to}")
        if self.series_budget_s <= 0:
            raise ConfigError(f"--series-budget must be > 0 seconds, got {self.series_budget_s:g}")
        self.sizing()  # validates the point's bounds against the first run's duration
        if self.kv_cache_tokens < 64:
            raise ConfigError("the device KV budget must be at least 64 tokens")
        if self.pause_mean_s is not None:
            self.workload_profile()  # validates the override against the profile's distribution
        self.sweep_spec()  # validates the sweep's shape (growth, resolution)
        self.load_spec()  # validates the load (join, run lengths)

    def workload_profile(self) -> WorkloadProfile:
        """The named profile, with its mean pause between turns replaced when one is given."""
        profile = get_profile(self.profile)
        if self.pause_mean_s is None:
            return profile
        if self.pause_mean_s <= 0:
            raise ConfigError("the mean pause between turns must be > 0 seconds")
        return profile.with_overrides(think_time_s=with_mean(profile.think_time_s, self.pause_mean_s))

    def load_spec(self) -> LoadSpec:
        """The closed loop every point runs (its level replaced per point)."""
        return LoadSpec("closed", 1, duration_s=self.duration_s, warmup_s=self.warmup_s, join=self.join)

    def sweep_spec(self) -> SweepSpec:
        return SweepSpec(self.start, self.max_level, self.growth, self.resolution, self.max_points,
                         budget_s=self.series_budget_s, probe_past_undecided=True)

    def sizing(self) -> PointSizing:
        """How long an undecided point may measure (its first run is ``duration_s``)."""
        return PointSizing(self.duration_s, max(self.duration_s, self.max_run_s),
                           max(self.duration_s, self.max_point_s))

    def describe_sizing(self) -> str:
        if self.confidence is None:
            return f"each point {self.repeats} runs of {self.duration_s:g} s, judged by the estimate"
        needs = ", ".join(f"{k} {n}" for k, n in values_needed_for(parse_slo(self.slo), self.confidence).items())
        return (f"each point {self.repeats} runs, the first {self.duration_s:g} s; an undecided point runs on until "
                f"each target has the values its {self.confidence:.0%} interval needs ({needs}) and as many as "
                f"its share within the target projects to decide it, at most {self.max_point_s:g} s a point "
                f"(less where the projection is out of reach) and {self.series_budget_s:g} s a series")

    def describe_profile(self) -> str:
        parts = ([] if self.pause_mean_s is None else [f"mean pause {self.pause_mean_s:g} s"]) + (
            ["chats joined mid-conversation"] if self.join == "steady" else [])
        return self.profile + (f" ({', '.join(parts)})" if parts else "")

    def engine_args(self) -> dict[str, EngineArgs]:
        pool = ("--kv-cache-tokens", str(self.kv_cache_tokens))
        return {"stock": engine_args((), self.techniques, pool),
                "tuned": engine_args(TECHNIQUES, self.techniques, pool)}


@dataclass
class DemoResult:
    sweeps: dict[str, SweepResult]
    fleets: dict[str, FleetPlan | None]
    ratio: KneeRatio | None  # tuned's knee over stock's, with its range; None: a knee is missing
    machine: MachineInfo
    other_work: dict[str, CpuUse]  # series (or 'all series' in parallel) -> CPU time other work took meanwhile
    json_path: Path
    html_path: Path
    seconds: float


def kv_budget_bytes(model_dir: Path, tokens: int, dtype: str = "float32") -> int:
    """Bytes of a device KV pool of ``tokens`` tokens (the memory arithmetic the engine uses)."""
    from chatfleet.engine.sizing.memory import memory_breakdown

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return memory_breakdown(config, dtype=dtype, kv_cache_tokens=tokens).kv_pool_bytes


def sweep_series(cfg: DemoConfig, series: SeriesSpec, con: Console) -> SweepResult:
    """Start the series' server, sweep it to the knee under ``cfg``'s protocol, stop it."""
    con.print(f"[bold]{series.name}[/]: {series.describe()}")
    with start_server(series, cfg.out_dir) as url:
        proto = RunProtocol(url, cfg.load_spec(), parse_slo(cfg.slo), repeats=cfg.repeats, base_seed=cfg.seed,
                            server_kind=series.server_kind, confidence=cfg.confidence,
                            extend_up_to=cfg.extend_up_to, sizing=cfg.sizing())
        make, _ = WorkloadSource(cfg.workload_profile(), cfg.model).factory()
        spec = cfg.sweep_spec()

        async def go() -> SweepResult:
            b = Bench(proto, ClientConfig(model=series.request_model), make,
                      ui.ProgressObserver(con, f"{series.name} "))
            try:
                return await sweep(b, spec)
            finally:
                await b.close()

        return run_async(go())


def demo_series(cfg: DemoConfig, model_dir: Path) -> list[SeriesSpec]:
    out = [SeriesSpec.chatfleet(name, cfg.model, a, cfg.threads) for name, a in cfg.engine_args().items()]
    if cfg.with_vllm:
        budget = kv_budget_bytes(model_dir, cfg.kv_cache_tokens)
        out.append(SeriesSpec.vllm("vllm", model_dir, budget, cfg.kv_cache_tokens, cfg.threads, cfg.vllm_python))
    return out


def run_demo(cfg: DemoConfig, con: Console | None = None) -> DemoResult:
    con = con or Console()
    t0 = time.monotonic()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    from chatfleet.engine.builtin_models.tiny import resolve_model

    path = resolve_model(cfg.model)
    budget = kv_budget_bytes(path, cfg.kv_cache_tokens)
    series = demo_series(cfg, path)
    machine = machine_info()
    con.print(f"machine: {machine.describe()}", highlight=False)
    code = code_version()
    con.print(describe_code(code), highlight=False)
    con.print(f"model [bold]{cfg.model}[/] at {path}; workload {cfg.describe_profile()}; SLO {cfg.slo}")
    con.print(f"device KV budget for every series: [bold]{cfg.kv_cache_tokens:,} tokens[/] "
              f"({budget / 2**20:.1f} MiB at float32); {cfg.repeats} repeats per load point")
    tuned = cfg.engine_args()["tuned"]
    con.print(f"tuned techniques: {tuned.describe()}")
    con.print(cfg.describe_sizing(), highlight=False)
    other_work: dict[str, CpuUse] = {}
    if cfg.parallel:
        watch = CpuWatch().start()
        with ThreadPoolExecutor(len(series)) as ex:
            futs = {s.name: ex.submit(sweep_series, cfg, s, con) for s in series}
            sweeps = {name: f.result() for name, f in futs.items()}
        other_work["all series"] = watch.stop()
    else:
        sweeps = {}
        for one in series:
            watch = CpuWatch().start()
            sweeps[one.name] = sweep_series(cfg, one, con)
            other_work[one.name] = watch.stop()
    fleets = {n: (plan_fleet(s.knee, cfg.peak_chats, cfg.headroom, cfg.price_per_gpu_hour) if s.knee else None)
              for n, s in sweeps.items()}
    for n, s in sweeps.items():
        con.print(ui.sweep_table(s, f"{n}: live chats vs SLO {s.slo}"))
        for line in ui.undecided_lines(s, "raise --max-point"):
            con.print(f"{n}: {line}", highlight=False)
        shown = next((p for p in s.points if p.level == s.knee), s.points[-1] if s.points else None)
        if shown is not None:
            for table in ui.breakdown_tables(shown.breakdown(), f"{n} at {shown.level:g} chats"):
                con.print(table)
    con.print(ui.fleet_table(fleets, f"fleet for {cfg.peak_chats} peak chats"))
    ratio = _print_knees(sweeps, con, cfg.kv_cache_tokens)
    disturbed = _print_other_work(other_work, con)
    machine_after = machine_info()
    knee_points = {n: next((p for p in s.points if p.level == s.knee), None) for n, s in sweeps.items()}
    settings = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                "working_set_tokens_at_knee": {n: (working_set_tokens(p) if p else None)
                                               for n, p in knee_points.items()},
                "engine_args": {s.name: list(s.args) for s in series}, "model_path": str(path),
                "kv_budget_bytes": budget, "tuned_techniques": list(tuned.applied),
                "tuned_techniques_missing": list(tuned.missing)}
    secs = time.monotonic() - t0
    verdicts = {n: {"knee": s.knee, "bracket": knee_bracket(s.points, s.knee).to_dict(),
                    "why_none": None if s.knee is not None else why_no_knee(s)}
                for n, s in sweeps.items()}
    doc = result_document("demo", settings, {n: sweep_to_dict(s) for n, s in sweeps.items()},
                          {"fleet": {n: (f.to_dict() if f else None) for n, f in fleets.items()},
                           "machine": {**machine.to_dict(), "load_average_after": list(machine_after.load_average),
                                       "other_work": {n: u.to_dict() for n, u in other_work.items()},
                                       "disturbed": disturbed, "disturbed_above_share": DISTURBED_SHARE},
                           "code": code,
                           "knees": verdicts, "ratio": _ratio_dict(ratio, sweeps), "seconds": secs})
    jp = write_json(doc, cfg.out_dir / "result.json")
    hp = write_html(doc, cfg.out_dir / "report.html")
    con.print(f"machine at the end: {machine_after.describe()}", highlight=False)
    con.print(f"result: {jp}\nreport: {hp}\n({secs:.0f} s)")
    return DemoResult(sweeps, fleets, ratio, machine, other_work, jp, hp, secs)


def working_set_tokens(point: PointResult) -> float | None:
    """About how many tokens of context the live chats of a closed-loop point hold: live chats x
    the mean context (prompt + reply) of their requests (shared cards counted per chat)."""
    contexts = [r.prompt_tokens + r.output_tokens for run in point.kept for r in run.records
                if not r.warmup and r.prompt_tokens]
    if not contexts:
        return None
    return point.level * sum(contexts) / len(contexts)


def why_no_knee(s: SweepResult) -> str:
    """Why a sweep called no knee: its lowest load broke the SLO, stayed undecided (and why), or
    the sweep's budget ran out before any load was shown to meet it."""
    lowest = min(s.points, key=lambda p: p.level, default=None)
    if lowest is None:
        return "no load was measured"
    if lowest.verdict == "undecided" and lowest.judged is not None:
        prefix = f"load {lowest.level:g} undecided after {len(lowest.runs)} runs: "
        why = "; ".join(line.removeprefix(prefix) for line in ui.undecided_lines(s, "raise --max-point")
                        if line.startswith(prefix))
        return f"the lowest load measured, {lowest.level:g}, stayed undecided after {len(lowest.runs)} runs: {why}"
    text = f"the lowest load measured, {lowest.level:g}, broke the SLO"
    return text + ("; the series' time budget ran out before a lower one" if s.out_of_budget else "")


def _ratio_dict(ratio: KneeRatio | None, sweeps: dict[str, SweepResult]) -> dict:
    if ratio is not None:
        return {"tuned_over_stock": {**ratio.to_dict(), "range_from": "knee brackets"}, "why_none": None}
    missing = [n for n in ("tuned", "stock") if n in sweeps and sweeps[n].knee is None]
    return {"tuned_over_stock": None, "why_none": f"no knee for {' and '.join(missing) or 'a series'}"}


def _print_knees(sweeps: dict[str, SweepResult], con: Console, pool_tokens: int) -> KneeRatio | None:
    """Each series' knee with its bracket (or why it has none), and tuned over stock with the range
    the two brackets give."""
    brackets: dict[str, KneeBracket] = {}
    for n, s in sweeps.items():
        bracket = brackets[n] = knee_bracket(s.points, s.knee)
        spread = knee_spread(s.points)
        shown = next((p for p in s.points if p.level == s.knee), None)
        ws = working_set_tokens(shown) if shown is not None else None
        memory = (f"; live chats' context there ~{ws:,.0f} tokens = {ws / pool_tokens:.1f}x the device pool"
                  if ws else "")
        if s.knee is None:
            con.print(f"[yellow]{n}: no knee (bracket {bracket.describe()}): {why_no_knee(s)}[/]", highlight=False)
        else:
            con.print(f"{n}: knee {s.knee:g} chats, bracket {bracket.describe()}; per repeat "
                      f"{spread.describe()}{memory}", highlight=False)
        if s.knee is not None and bracket.broken is None:
            more = ("its time budget ran out (raise --series-budget)" if s.out_of_budget else
                    "raise --max-points" if s.knee_reached else "raise --max-points or the top load")
            con.print(f"[yellow]{n}: no load above {s.knee:g} was shown to break the SLO, so its knee is "
                      f"at least {s.knee:g} and the bracket is open above ({more})[/]")
    stock, tuned = sweeps.get("stock"), sweeps.get("tuned")
    if stock is None or tuned is None:
        return None
    ratio = bracket_ratio(brackets["tuned"], brackets["stock"])
    if ratio is None:
        missing = " and ".join(n for n, sw in (("tuned", tuned), ("stock", stock)) if sw.knee is None)
        con.print(f"[yellow]no tuned/stock ratio: no knee for {missing} (see above)[/]")
        return None
    con.print(f"tuned holds [bold]{ratio.describe()}[/] the live chats of stock "
              f"({tuned.knee:g} vs {stock.knee:g}) inside the SLO at the same device KV budget")
    return ratio


def _print_other_work(other_work: dict[str, CpuUse], con: Console) -> bool:
    """How much CPU other work took during each series; True (and a warning) where it disturbed one."""
    if not other_work:
        return False
    parts = "; ".join(f"{n}'s sweep {u.describe()}" for n, u in other_work.items())
    disturbed = [n for n, u in other_work.items() if u.disturbed]
    if not disturbed:
        con.print(f"other work on the machine: {parts}: quiet (under {DISTURBED_SHARE:.0%} at normal priority)",
                  highlight=False)
        return False
    con.print(f"[yellow]DISTURBED: other work at normal priority took over {DISTURBED_SHARE:.0%} of the CPUs during "
              f"{' and '.join(disturbed)} ({parts}). The knees measured a machine shared with it, "
              "and the ratio's range does not cover that: rerun on a quiet machine to compare.[/]", highlight=False)
    return True
