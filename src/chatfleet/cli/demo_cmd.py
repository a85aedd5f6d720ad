"""`chatfleet demo`: stock vs tuned built-in engine at one scarce KV budget, knees and fleet sizes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import typer

from chatfleet.bench.demo import DemoConfig
from chatfleet.bench.techniques import TechniqueSettings
from chatfleet.errors import ChatfleetError

_HELP = ("Build `small` if missing, sweep the engine stock (its defaults) and tuned (warm-cache techniques) "
         "at the same scarce device KV budget with long-session chats, size both fleets.")
_D, _T = DemoConfig(), TechniqueSettings()


def demo(
    model: str = typer.Option(_D.model, "--model", help="'small' (default), 'tiny' or a local HF folder."),
    profile: str = typer.Option(_D.profile, "--profile", help="Workload profile (long-session: users who pause)."),
    join: str = typer.Option(_D.join, "--join", help="steady: live chats are joined mid-conversation (a "
                             "fleet in steady state); start: every chat from its first turn."),
    slo: str = typer.Option(_D.slo, "--slo", help="Latency targets."),
    peak: int = typer.Option(_D.peak_chats, "--peak", help="Peak concurrent chats to size the fleets for."),
    headroom: float = typer.Option(_D.headroom, "--headroom", help="Provision this share above the peak."),
    price: float | None = typer.Option(None, "--price", help="Price per GPU-hour, for cost per conversation-hour."),
    threads: int = typer.Option(_D.threads, "--threads", help="torch threads per engine."),
    parallel: bool = typer.Option(False, "--parallel", help="Run the series at once (use --threads 1) "
                                  "instead of one after the other."),
    duration: float = typer.Option(_D.duration_s, "--duration", help="Measured seconds of a point's first run; an "
                                   "undecided point runs on until its intervals can decide it."),
    max_point: float = typer.Option(_D.max_point_s, "--max-point", help="Most measured seconds per load point."),
    series_budget: float = typer.Option(_D.series_budget_s, "--series-budget",
                                        help="Most measured seconds per series (its sweep stops there)."),
    warmup: float = typer.Option(_D.warmup_s, "--warmup", help="Warmup seconds per load point."),
    start: int = typer.Option(_D.start, "--start", help="First load level (live chats); doubled until the SLO breaks."),
    max_points: int = typer.Option(_D.max_points, "--max-points", help="Most load points per series."),
    repeats: int = typer.Option(_D.repeats, "--repeats", help="Runs per load point (the knee's spread)."),
    confidence: float = typer.Option(_D.confidence or 0.0, "--confidence", help="Judge a point by intervals at "
                                     "this level (undecided is measured again); 0: by the estimate alone."),
    extend_up_to: int = typer.Option(_D.extend_up_to, "--extend-up-to",
                                     help="An undecided point runs up to this many times --repeats."),
    kv_cache_tokens: int = typer.Option(_D.kv_cache_tokens, "--kv-cache-tokens",
                                        help="Device KV budget (tokens) of every series: scarce, so memory binds."),
    max_running: int = typer.Option(_T.max_running, "--max-running", help="Tuned: the cap on running requests."),
    host_cache_memory: str = typer.Option(_T.host_cache_memory, "--host-cache-memory", help="Tuned: host tier size."),
    with_vllm: bool = typer.Option(False, "--with-vllm", help="Add vLLM's CPU build at the same budget and dtype."),
    vllm_python: Path | None = typer.Option(None, "--vllm-python", help="Python of vLLM's venv "
                                            "(default: benchmarks/.venv-vllm/bin/python)."),
    seed: int = typer.Option(_D.seed, "--seed", help="Base seed."),
    out_dir: Path | None = typer.Option(None, "--out-dir", help="Where result.json and report.html go."),
) -> None:
    from chatfleet.bench.demo import run_demo

    try:
        tech = TechniqueSettings(max_running=max_running, host_cache_memory=host_cache_memory)
        cfg = DemoConfig(model=model, profile=profile, join=join, slo=slo, peak_chats=peak, headroom=headroom,
                         price_per_gpu_hour=price, threads=threads, parallel=parallel, duration_s=duration,
                         max_point_s=max_point, series_budget_s=series_budget, warmup_s=warmup, start=start,
                         max_points=max_points, repeats=repeats,
                         confidence=confidence or None, extend_up_to=extend_up_to, kv_cache_tokens=kv_cache_tokens,
                         techniques=tech, with_vllm=with_vllm, vllm_python=vllm_python, seed=seed)
        if out_dir:  # else the config's own default: a new folder under runs/
            cfg = replace(cfg, out_dir=out_dir)
        run_demo(cfg)
    except ChatfleetError as e:
        typer.echo(f"error: {e.message}", err=True)
        raise typer.Exit(2) from None


def register(app: typer.Typer) -> None:
    """Add `demo` to `app`."""
    app.command("demo", help=_HELP)(demo)
