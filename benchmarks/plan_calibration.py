"""Calibrate the planner on one measured sweep, then predict the knee of two other configurations.

Three configurations of the built-in engine serving `small` on one thread, each swept to its knee
by the bench's own sweep (closed loop, `cpu-roleplay` chats, lengths counted with `small`'s
tokenizer) against a real engine:

    A  --kv-cache-tokens 2048                                  (calibrated on)
    B  --kv-cache-tokens 4096                                  (a different KV budget)
    C  --kv-cache-tokens 2048 --max-running 6 --host-cache-memory 64MiB   (a different cap, host tier on)

Then the `cpu` catalog entry's efficiency factors are fitted to A's sweep (what `chatfleet plan
calibrate` does) and the same sweep (same levels search, seeds, run length and SLO) is simulated
for A, B and C with the fitted factors. Prints predicted vs measured knees side by side (and each
measured level's latencies beside the simulated ones) and writes JSON plus each measured sweep's
result file under --out-dir.

    flock /tmp/chatfleet-measure.lock python benchmarks/plan_calibration.py          # ~12 min
    python benchmarks/plan_calibration.py --measured benchmarks/results/plan_calibration  # predict only

With --lock FILE the measured sweeps take that lock one at a time (flock) instead, and the
simulation afterwards runs at the lowest CPU priority.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console

from chatfleet.bench.demo import DemoConfig, sweep_series
from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.report import load_result, result_document, sweep_to_dict, write_json
from chatfleet.bench.servers import SeriesSpec
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.sources import WorkloadSource
from chatfleet.bench.sweep import SweepSpec
from chatfleet.bench.techniques import EngineArgs
from chatfleet.bench.tokens import load_counter
from chatfleet.bench.workload import get_profile
from chatfleet.engine.config import SchedulerConfig, parse_memory_size
from chatfleet.plan.calibrate import fit_efficiency, read_measured
from chatfleet.plan.catalog import load_catalog
from chatfleet.plan.memory_report import read_model_config
from chatfleet.plan.replica_setup import ServingConfig, replica_plan
from chatfleet.plan.sim_bench import sim_protocol, simulate_levels, simulate_sweep

MODEL = "small"


@dataclass(frozen=True)
class Config:
    name: str
    role: str
    kv_cache_tokens: int
    max_running: int = SchedulerConfig.max_running
    host_cache: str = "0"

    def engine_args(self) -> tuple[str, ...]:
        args = ["--kv-cache-tokens", str(self.kv_cache_tokens)]
        if self.max_running != SchedulerConfig.max_running:
            args += ["--max-running", str(self.max_running)]
        if self.host_cache != "0":
            args += ["--host-cache-memory", self.host_cache]
        return tuple(args)

    def serving(self) -> ServingConfig:
        host = parse_memory_size(self.host_cache) if self.host_cache != "0" else 0
        return ServingConfig(weights="fp32", kv_cache_tokens=self.kv_cache_tokens, host_cache_bytes=host,
                             scheduler=SchedulerConfig(max_running=self.max_running))

    def describe(self) -> str:
        return " ".join(self.engine_args())


CONFIGS = (
    Config("A", "calibrated on", 2048),
    Config("B", "other KV budget", 4096),
    Config("C", "other cap, host tier", 2048, max_running=6, host_cache="64MiB"),
)


@contextlib.contextmanager
def measurement_lock(path: str | None):
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def measure(cfg: Config, args, out_dir: Path, con: Console) -> dict:
    """One real sweep of ``cfg`` (engine started and stopped here); returns its result document."""
    series = SeriesSpec.chatfleet(cfg.name, MODEL, EngineArgs(cfg.engine_args(), (), ()), args.threads)
    con.print(f"[bold]{cfg.name}[/] ({cfg.role})")
    sweep_cfg = sweep_config(args, out_dir)
    t = time.monotonic()
    with measurement_lock(args.lock):
        res = sweep_series(sweep_cfg, series, con)
    con.print(f"{cfg.name}: measured knee {res.knee} ({time.monotonic() - t:.0f} s)")
    settings = {"argv": sys.argv[1:], "model": MODEL, "engine_args": list(cfg.engine_args()), "threads": args.threads,
                "profile": asdict(get_profile(args.profile)), "tokenizer": load_counter(MODEL).name,
                "protocol": {"load": {"duration_s": args.duration, "warmup_s": args.warmup}, "slo": args.slo,
                             "base_seed": args.seed},
                "sweep": asdict(sweep_cfg.sweep_spec())}
    doc = result_document("sweep", settings, {cfg.name: sweep_to_dict(res)})
    write_json(doc, out_dir / f"measured-{cfg.name}.json")
    return doc


def sweep_config(args, out_dir: Path) -> DemoConfig:
    """The measured sweeps' protocol (one repeat per point), as the demo and capacity.py run theirs."""
    return DemoConfig(model=MODEL, profile=args.profile, join="start", slo=args.slo, threads=args.threads,
                      duration_s=args.duration, warmup_s=args.warmup, start=args.start, max_level=args.max,
                      growth=args.growth, resolution=args.resolution, max_points=args.max_points, repeats=1,
                      seed=args.seed, out_dir=out_dir)


def sweep_spec(args) -> SweepSpec:
    return sweep_config(args, args.out_dir).sweep_spec()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu-roleplay")
    ap.add_argument("--slo", default="ttft_p95<=1s,itl_p95<=200ms")
    ap.add_argument("--duration", type=float, default=20.0, help="measured seconds per load point")
    ap.add_argument("--warmup", type=float, default=4.0)
    ap.add_argument("--start", type=float, default=2)
    ap.add_argument("--max", type=float, default=48)
    ap.add_argument("--growth", type=float, default=2.0)
    ap.add_argument("--resolution", type=float, default=2.0, help="the sweep step: bisect to this many chats")
    ap.add_argument("--max-points", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lock", default=None, help="take this flock around each measured sweep")
    ap.add_argument("--measured", type=Path, default=None, help="reuse measured-{A,B,C}.json from this folder")
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/plan_calibration"))
    args = ap.parse_args()
    con = Console(width=150)
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    measured_docs: dict[str, dict] = {}
    for cfg in CONFIGS:
        if args.measured is not None:
            measured_docs[cfg.name] = load_result(args.measured / f"measured-{cfg.name}.json")
        else:
            measured_docs[cfg.name] = measure(cfg, args, out_dir, con)
    measure_s = time.monotonic() - t0
    with contextlib.suppress(OSError):
        os.nice(19)  # the simulation needs no quiet machine

    model_cfg, _ = read_model_config(MODEL)
    cpu = load_catalog().get("cpu")
    a = read_measured(measured_docs["A"])
    proto = sim_protocol(LoadSpec("closed", 1, duration_s=a.duration_s, warmup_s=a.warmup_s), parse_slo(a.slo),
                         base_seed=args.seed)
    make, _ = WorkloadSource(get_profile(a.profile), a.tokenizer).factory()
    t = time.monotonic()
    fit = fit_efficiency(a, lambda e: simulate_levels(proto, a.levels, make,
                                                      replica_plan(model_cfg, cpu, CONFIGS[0].serving(), efficiency=e)),
                         cpu.efficiency)
    fit_s = time.monotonic() - t
    eff = fit.efficiency
    con.print(f"fitted on A ({fit.evaluations} candidates, {fit_s:.0f} s): compute {eff.compute:.3g}, memory "
              f"{eff.memory:.3g}, step overhead {eff.step_overhead_ms:.3g} ms (rms log error {fit.error ** 0.5:.3f})")

    rows, detail = [], {}
    for cfg in CONFIGS:
        m = read_measured(measured_docs[cfg.name])
        plan = replica_plan(model_cfg, cpu, cfg.serving(), efficiency=eff)
        t = time.monotonic()
        pred = simulate_sweep(proto, sweep_spec(args), make, plan)
        sim_s = time.monotonic() - t
        levels = simulate_levels(proto, m.levels, make, plan)
        detail[cfg.name] = {"measured": {str(k): v for k, v in m.metrics.items()},
                            "simulated": {str(k): v for k, v in levels.items()},
                            "predicted_levels": {f"{p.level:g}": p.passed for p in pred.points}}
        passed = _passed(measured_docs[cfg.name])
        step = _step(passed, m.knee)
        ok = m.knee is not None and pred.knee is not None and step is not None and abs(pred.knee - m.knee) <= step
        rows.append({"config": cfg.name, "role": cfg.role, "engine_args": cfg.describe(), "measured_knee": m.knee,
                     "predicted_knee": pred.knee, "within_one_step": ok, "sweep_step": step,
                     "measured_levels": {f"{lv:g}": p for lv, p in passed.items()},
                     "simulate_s": sim_s})

    con.print(f"\nknee (live chats within {args.slo}); calibrated on A; step: the measured sweep's last bracket")
    con.print(f"{'config':<6} {'engine flags':<62} {'measured':>8} {'predicted':>9} {'step':>5} {'within':>6}")
    for r in rows:
        con.print(f"{r['config']:<6} {r['engine_args']:<62} {_k(r['measured_knee']):>8} {_k(r['predicted_knee']):>9}"
                  f" {_k(r['sweep_step']):>5} {'yes' if r['within_one_step'] else 'NO':>6}", highlight=False)
    con.print("\nlatencies at the measured levels (ms): measured / simulated")
    for name, d in detail.items():
        for level, mv in d["measured"].items():
            sv = d["simulated"].get(level, {})
            cells = "  ".join(f"{key} {mv.get(key, float('nan')) * 1e3:7.1f} / {sv.get(key, float('nan')) * 1e3:7.1f}"
                              for key in ("itl_p50", "itl_p90", "ttft_p50"))
            con.print(f"{name} {float(level):>4g}: {cells}", highlight=False)
    doc = {"model": MODEL, "threads": args.threads, "profile": args.profile, "slo": args.slo,
           "duration_s": args.duration, "warmup_s": args.warmup, "sweep": asdict(sweep_spec(args)),
           "efficiency": asdict(eff), "fit_error": fit.error, "measure_s": measure_s, "rows": rows, "detail": detail,
           "argv": sys.argv[1:]}
    path = out_dir / "plan_calibration.json"
    path.write_text(json.dumps(doc, indent=2))
    con.print(f"wrote {path}")


def _passed(doc: dict) -> dict[float, bool]:
    series = next(iter(doc["series"].values()))
    return {float(p["level"]): bool(p["passed"]) for p in series["points"]}


def _step(passed: dict[float, bool], knee: float | None) -> float | None:
    """The sweep's step at the knee: from the knee to the lowest failing level above it."""
    above = [lv for lv, ok in passed.items() if not ok and (knee is None or lv > knee)]
    if knee is None or not above:
        return None
    return min(above) - knee


def _k(x) -> str:
    return "none" if x is None else f"{x:g}"


if __name__ == "__main__":
    main()
