"""`chatfleet demo`: the built-in engine stock vs tuned, swept with role-play traffic, knees and
fleet sizes side by side.

Stock: no prefix cache, no concurrency cap, whole prompts per step. Tuned: prefix cache, a
cap on running requests, chunked prefill. The two engines run one after the other, each with
the same threads, so neither steals the other's cores (``parallel`` runs them at once, each
with its own threads: faster, but each engine's load then slows the other).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console

from chatfleet.bench import console as ui
from chatfleet.bench.client import ClientConfig
from chatfleet.bench.fleet import FleetPlan, plan_fleet
from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.report import result_document, sweep_to_dict, write_html, write_json
from chatfleet.bench.sources import WorkloadSource, run_async
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.sweep import Bench, RunProtocol, SweepResult, SweepSpec, sweep
from chatfleet.bench.workload import get_profile
from chatfleet.errors import ConfigError
from chatfleet.testing.engines import launch_engine


@dataclass(frozen=True)
class DemoConfig:
    model: str = "small"
    profile: str = "cpu-roleplay"
    slo: str = "ttft_p95<=1s,itl_p95<=200ms"
    peak_chats: int = 2200
    headroom: float = 0.0
    price_per_gpu_hour: float | None = None
    threads: int = 2
    duration_s: float = 10.0
    warmup_s: float = 3.0
    start: int = 2
    max_level: int = 64
    max_points: int = 6
    repeats: int = 1
    seed: int = 0
    parallel: bool = False  # both engines at once (threads each); default: one after the other
    tuned_max_running: int = 8
    tuned_max_batched_tokens: int = 256
    kv_cache_tokens: int | None = None  # same pool for both; None: the engine's default
    stock_args: tuple[str, ...] = (
        "--no-prefix-cache", "--no-chunked-prefill", "--max-running", "1024", "--max-batched-tokens", "8192"
    )
    out_dir: Path = field(default_factory=lambda: Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))

    def __post_init__(self) -> None:
        parse_slo(self.slo)
        get_profile(self.profile)
        if self.threads < 1 or self.peak_chats < 1 or self.max_points < 2:
            raise ConfigError("threads and peak chats must be >= 1, max points >= 2")

    def engine_args(self) -> dict[str, list[str]]:
        pool = ["--kv-cache-tokens", str(self.kv_cache_tokens)] if self.kv_cache_tokens else []
        tuned = ["--max-running", str(self.tuned_max_running), "--max-batched-tokens", str(self.tuned_max_batched_tokens)]
        return {"stock": [*self.stock_args, *pool], "tuned": [*tuned, *pool]}


@dataclass
class DemoResult:
    sweeps: dict[str, SweepResult]
    fleets: dict[str, FleetPlan | None]
    json_path: Path
    html_path: Path
    seconds: float


def _sweep_engine(cfg: DemoConfig, name: str, args: list[str], con: Console) -> SweepResult:
    log = cfg.out_dir / f"engine-{name}.log"
    con.print(f"[bold]{name}[/]: chatfleet engine --model {cfg.model} {' '.join(args)} (threads {cfg.threads})")
    with launch_engine(cfg.model, args, threads=cfg.threads, log_dir=log.parent, log_name=log.stem) as eng:
        load = LoadSpec("closed", 1, duration_s=cfg.duration_s, warmup_s=cfg.warmup_s)
        proto = RunProtocol(eng.url, load, parse_slo(cfg.slo), repeats=cfg.repeats, base_seed=cfg.seed,
                            server_kind="chatfleet")
        make, _ = WorkloadSource(get_profile(cfg.profile), cfg.model).factory()
        spec = SweepSpec(cfg.start, cfg.max_level, 2.0, 1.0, cfg.max_points)

        async def go() -> SweepResult:
            b = Bench(proto, ClientConfig(model=cfg.model), make, ui.ProgressObserver(con, f"{name} "))
            try:
                return await sweep(b, spec)
            finally:
                await b.close()

        return run_async(go())


def run_demo(cfg: DemoConfig, con: Console | None = None) -> DemoResult:
    con = con or Console()
    t0 = time.monotonic()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    from chatfleet.models.tiny import resolve_model

    path = resolve_model(cfg.model)
    con.print(f"model [bold]{cfg.model}[/] at {path}; workload {cfg.profile}; SLO {cfg.slo}")
    if cfg.parallel:
        with ThreadPoolExecutor(2) as ex:
            futs = {name: ex.submit(_sweep_engine, cfg, name, args, con) for name, args in cfg.engine_args().items()}
            sweeps = {name: f.result() for name, f in futs.items()}
    else:
        sweeps = {name: _sweep_engine(cfg, name, args, con) for name, args in cfg.engine_args().items()}
    fleets = {n: (plan_fleet(s.knee, cfg.peak_chats, cfg.headroom, cfg.price_per_gpu_hour) if s.knee else None)
              for n, s in sweeps.items()}
    for n, s in sweeps.items():
        con.print(ui.sweep_table(s, f"{n}: live chats vs SLO {s.slo}"))
    con.print(ui.fleet_table(fleets, f"fleet for {cfg.peak_chats} peak chats"))
    knees = {n: s.knee for n, s in sweeps.items()}
    for n, s in sweeps.items():
        if s.knee is not None and not s.knee_reached:
            con.print(f"[yellow]{n}: the SLO held up to the last load measured ({s.knee:g}); "
                      "its knee is at least that (raise --max-points)[/]")
    if knees["stock"] and knees["tuned"]:
        con.print(f"tuned holds [bold]{knees['tuned'] / knees['stock']:.2f}x[/] the live chats of stock "
                  f"({knees['tuned']:g} vs {knees['stock']:g}) inside the SLO")
    settings = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                "engine_args": cfg.engine_args(), "model_path": str(path)}
    doc = result_document("demo", settings, {n: sweep_to_dict(s) for n, s in sweeps.items()},
                          {"fleet": {n: (f.to_dict() if f else None) for n, f in fleets.items()}})
    jp = write_json(doc, cfg.out_dir / "result.json")
    hp = write_html(doc, cfg.out_dir / "report.html")
    secs = time.monotonic() - t0
    con.print(f"result: {jp}\nreport: {hp}\n({secs:.0f} s)")
    return DemoResult(sweeps, fleets, jp, hp, secs)
