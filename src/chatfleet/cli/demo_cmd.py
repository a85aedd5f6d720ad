"""`chatfleet demo`: stock vs tuned built-in engine, knees and fleet sizes side by side."""

from __future__ import annotations

from pathlib import Path

import typer

from chatfleet.errors import ChatfleetError

_HELP = "Build `small` if missing, sweep the engine stock and tuned with role-play chats, size both fleets."


def demo(
    model: str = typer.Option("small", "--model", help="'small' (default), 'tiny' or a local HF folder."),
    slo: str = typer.Option("ttft_p95<=1s,itl_p95<=200ms", "--slo", help="Latency targets."),
    peak: int = typer.Option(2200, "--peak", help="Peak concurrent chats to size the fleets for."),
    headroom: float = typer.Option(0.0, "--headroom", help="Provision this share above the peak."),
    price: float | None = typer.Option(None, "--price", help="Price per GPU-hour, for cost per conversation-hour."),
    threads: int = typer.Option(2, "--threads", help="torch threads per engine."),
    parallel: bool = typer.Option(False, "--parallel", help="Run both engines at once (use --threads 1) "
                                  "instead of one after the other."),
    duration: float = typer.Option(10.0, "--duration", help="Measured seconds per load point."),
    warmup: float = typer.Option(3.0, "--warmup", help="Warmup seconds per load point."),
    max_points: int = typer.Option(6, "--max-points", help="Most load points per engine."),
    repeats: int = typer.Option(1, "--repeats", help="Runs per load point (tighter knees, longer demo)."),
    kv_cache_tokens: int | None = typer.Option(None, "--kv-cache-tokens", help="KV pool (tokens) for both engines."),
    seed: int = typer.Option(0, "--seed", help="Base seed."),
    out_dir: Path | None = typer.Option(None, "--out-dir", help="Where result.json and report.html go."),
) -> None:
    """Build `small` if missing, sweep the engine stock and tuned with role-play chats, size both fleets."""
    from chatfleet.bench.demo import DemoConfig, run_demo

    try:
        kw = {"out_dir": out_dir} if out_dir else {}
        cfg = DemoConfig(model=model, slo=slo, peak_chats=peak, headroom=headroom, price_per_gpu_hour=price,
                         threads=threads, parallel=parallel, duration_s=duration, warmup_s=warmup, max_points=max_points, repeats=repeats,
                         kv_cache_tokens=kv_cache_tokens, seed=seed, **kw)
        run_demo(cfg)
    except ChatfleetError as e:
        typer.echo(f"error: {e.message}", err=True)
        raise typer.Exit(2) from None


def register(app: typer.Typer) -> None:
    """Add `demo` to `app`."""
    app.command("demo", help=_HELP)(demo)
