"""`chatfleet plan sweep` / `plan fleet`: the bench's sweeps in virtual time (options shared here)."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from chatfleet.bench import console as ui
from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.report import result_document, sweep_to_dict, write_html, write_json
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.sources import WorkloadSource
from chatfleet.bench.sweep import SweepSpec
from chatfleet.bench.workload import PROFILES, get_profile
from chatfleet.cli.plan_output import O_CATALOG, out
from chatfleet.cli.plan_output import fail as _fail
from chatfleet.engine.config import SchedulerConfig, parse_memory_size
from chatfleet.errors import ChatfleetError

O_MODEL = typer.Option(..., "--model", help="A model folder, its config.json, or 'tiny'/'small'.")
O_GPU = typer.Option(..., "--gpu", help="GPU name from the catalog (a calibrated entry via --catalog).")
O_WEIGHTS = typer.Option("bf16", "--weights", help="bf16, fp16, fp32 or fp8.")
O_KV = typer.Option("auto", "--kv", help="KV cache dtype: auto (= weights), bf16, fp16, fp32, fp8.")
O_FRACTION = typer.Option(None, "--memory-fraction", help="Budget = fraction x GPU memory - reserve (default 0.9).")
O_BUDGET = typer.Option(None, "--budget", help="Bytes for weights + KV cache.")
O_KVMEM = typer.Option(None, "--kv-cache-memory",
                       help="The KV pool's bytes, as the engine's flag (instead of a budget).")
O_KVTOK = typer.Option(None, "--kv-cache-tokens", help="The KV pool in tokens, as the engine's flag.")
O_HOST = typer.Option("0", "--host-cache-memory", help="Host-memory KV tier (e.g. '8GiB'; 0: none).")
O_CAP = typer.Option(SchedulerConfig.max_running, "--max-running", help="Engine concurrency cap.")
O_TOKENS = typer.Option(SchedulerConfig.max_batched_tokens, "--max-batched-tokens", help="Per-step token budget.")
O_PROFILE = typer.Option("seed-roleplay", "--profile", help=f"Workload profile: {', '.join(PROFILES)}.")
O_TOKENIZER = typer.Option(None, "--tokenizer", help="Count workload lengths with this tokenizer ('small', a folder;"
                           " default: the bench's byte estimate), as `chatfleet sweep --tokenizer` does.")
O_SLO = typer.Option("ttft_p99<=1s,itl_p99<=100ms", "--slo", help="Targets, as for `chatfleet sweep`.")
O_MODE = typer.Option("closed", "--mode", help="closed (live chats), open (new chats/s) or concurrency.")
O_DURATION = typer.Option(600.0, "--duration", help="Simulated seconds measured per run.")
O_WARMUP = typer.Option(120.0, "--warmup", help="Simulated warmup seconds per run (excluded).")
O_REPEATS = typer.Option(1, "--repeats", help="Runs per load point.")
O_SEED = typer.Option(0, "--seed", help="Base seed.")
O_CHECK = typer.Option(False, "--check-contents", help="SimRunner content checks on (slower; fast mode skips them).")
O_SCALE = typer.Option(1, "--token-scale", help="Coarse time: one simulated token stands for this many (a power of"
                       " two; 1 = every engine step exactly; 8 runs ~8x faster, prefix hits in 8x coarser blocks).")
O_OUT = typer.Option(None, "--out", help="Write the JSON result (the format `chatfleet sweep` writes).")
O_HTML = typer.Option(None, "--html", help="Write the HTML report.")


def replica_from_options(model, gpu, catalog, weights, kv, memory_fraction, budget, kv_cache_memory, kv_cache_tokens,
                         host, max_running, max_batched_tokens, check_contents, token_scale=1):
    from chatfleet.plan.catalog import load_catalog
    from chatfleet.plan.memory_report import DEFAULT_RESERVE, budget_for, read_model_config
    from chatfleet.plan.replica_setup import ServingConfig, replica_plan

    g = load_catalog(catalog).get(gpu)
    cfg, _ = read_model_config(model)
    kv_bytes = parse_memory_size(kv_cache_memory) if kv_cache_memory else None
    b = (None if (kv_bytes or kv_cache_tokens)
         else budget_for(g, memory_fraction, parse_memory_size(budget) if budget else None, DEFAULT_RESERVE))
    s = ServingConfig(weights=weights, kv=kv, budget_bytes=b, kv_cache_bytes=kv_bytes, kv_cache_tokens=kv_cache_tokens,
                      host_cache_bytes=parse_memory_size(host) if host not in ("0", "") else 0,
                      scheduler=SchedulerConfig(max_batched_tokens=max_batched_tokens, max_running=max_running))
    return g, s, replica_plan(cfg, g, s, fast=not check_contents, token_scale=token_scale)


def plan_sweep(model: str = O_MODEL, gpu: str = O_GPU, catalog: Path | None = O_CATALOG, weights: str = O_WEIGHTS,
               kv: str = O_KV, memory_fraction: float | None = O_FRACTION, budget: str | None = O_BUDGET,
               kv_cache_memory: str | None = O_KVMEM, kv_cache_tokens: int | None = O_KVTOK, host: str = O_HOST,
               max_running: int = O_CAP, max_batched_tokens: int = O_TOKENS, profile: str = O_PROFILE,
               tokenizer: str | None = O_TOKENIZER, slo: str = O_SLO, mode: str = O_MODE, duration: float = O_DURATION,
               warmup: float = O_WARMUP, repeats: int = O_REPEATS, seed: int = O_SEED,
               start: float = typer.Option(8, "--start", help="First load level."),
               max_level: float = typer.Option(4096, "--max", help="Highest load level to try."),
               growth: float = typer.Option(2.0, "--growth", help="Factor between levels until the SLO breaks."),
               resolution: float = typer.Option(1.0, "--resolution", help="Bisect until the bracket is this narrow."),
               max_points: int = typer.Option(16, "--max-points", help="Most load points to simulate."),
               check_contents: bool = O_CHECK, token_scale: int = O_SCALE, out_path: Path | None = O_OUT,
               html: Path | None = O_HTML) -> None:
    """Predict one replica's knee: the bench's sweep, every run simulated in virtual time."""
    from chatfleet.plan.sim_bench import sim_protocol, simulate_sweep

    try:
        g, s, replica = replica_from_options(model, gpu, catalog, weights, kv, memory_fraction, budget, kv_cache_memory,
                                             kv_cache_tokens, host, max_running, max_batched_tokens, check_contents,
                                             token_scale)
        proto = sim_protocol(LoadSpec(mode, 1, duration_s=duration, warmup_s=warmup), parse_slo(slo), repeats, seed)
        spec = SweepSpec(start, max_level, growth, resolution, max_points)
        make, counter = WorkloadSource(get_profile(profile), tokenizer).factory()
        t = time.perf_counter()
        res = simulate_sweep(proto, spec, make, replica, ui.ProgressObserver())
        wall = time.perf_counter() - t
    except ChatfleetError as e:
        _fail(e)
    kv_tokens = replica.num_blocks * s.block_size * replica.token_scale
    name = f"simulated {g.name} ({kv_tokens} KV tokens, cap {max_running})"
    out.print(ui.sweep_table(res, f"{name} ({mode}, SLO {res.slo})"))
    knee = "none" if res.knee is None else f"{res.knee:g}" + ("" if res.knee_reached else " (max reached)")
    out.print(f"predicted knee: [bold]{knee}[/]  ({wall:.1f} s of wall time)")
    out.print(f"{g.name} step costs: {g.step_costs}", highlight=False, markup=False)
    settings = {"argv": __import__("sys").argv[1:], "simulated": True, "gpu": g.to_yaml_entry() | {"name": g.name},
                "serving": {"weights": weights, "kv": kv, "kv_tokens": kv_tokens, "token_scale": token_scale,
                            "host_blocks": replica.num_host_blocks, "max_running": max_running,
                            "max_batched_tokens": max_batched_tokens},
                "profile": profile, "tokenizer": counter.name, "protocol": {"load": vars(proto.load), "slo": slo},
                "sweep": vars(spec)}
    doc = result_document("sweep", settings, {name: sweep_to_dict(res)})
    if out_path:
        write_json(doc, out_path)
        out.print(f"result: {out_path}")
    if html:
        write_html(doc, html)
        out.print(f"report: {html}")


def plan_fleet(model: str = O_MODEL, gpu: str = O_GPU, catalog: Path | None = O_CATALOG, weights: str = O_WEIGHTS,
               kv: str = O_KV, memory_fraction: float | None = O_FRACTION, budget: str | None = O_BUDGET,
               kv_cache_memory: str | None = O_KVMEM, kv_cache_tokens: int | None = O_KVTOK, host: str = O_HOST,
               max_running: int = O_CAP, max_batched_tokens: int = O_TOKENS, profile: str = O_PROFILE,
               slo: str = O_SLO, duration: float = O_DURATION, warmup: float = O_WARMUP, seed: int = O_SEED,
               peak: int = typer.Option(..., "--peak", help="Peak live chats the fleet must hold (closed loop)."),
               knee: float | None = typer.Option(None, "--knee",
                                                 help="One replica's knee (default: simulate its sweep)."),
               max_extra: int = typer.Option(4, "--max-extra", help="Most replicas to add beyond the naive size."),
               routing: str = typer.Option("bounded_load", "--routing", help="Gateway routing policy."),
               load_factor: float = typer.Option(1.25, "--load-factor", help="bounded_load's c."),
               max_in_flight: int | None = typer.Option(None, "--max-in-flight",
                                                        help="Gateway cap per replica (default: the engine's cap)."),
               check_contents: bool = O_CHECK, token_scale: int = O_SCALE) -> None:
    """Fleet size under uneven traffic: N replicas behind the gateway's routing and admission,
    versus 'peak / chats per replica'."""
    from chatfleet.plan.sim_bench import sim_protocol, simulate_sweep
    from chatfleet.plan.sim_fleet import size_fleet

    try:
        g, s, replica = replica_from_options(model, gpu, catalog, weights, kv, memory_fraction, budget, kv_cache_memory,
                                             kv_cache_tokens, host, max_running, max_batched_tokens, check_contents,
                                             token_scale)
        proto = sim_protocol(LoadSpec("closed", 1, duration_s=duration, warmup_s=warmup), parse_slo(slo), 1, seed)
        make, _ = WorkloadSource(get_profile(profile)).factory()
        t = time.perf_counter()
        if knee is None:
            res = simulate_sweep(proto, SweepSpec(8, max(8, peak), 2.0, 1.0, 16), make, replica)
            if res.knee is None:
                raise ChatfleetError("one replica breaks the SLO at the lowest load: no fleet size")
            knee = res.knee
            out.print(f"one replica's simulated knee: {knee:g} chats")
        from chatfleet.gateway.config import GatewayConfig

        gateway = GatewayConfig(routing_policy=routing, load_factor=load_factor, max_in_flight=max_in_flight)
        sizing = size_fleet(proto, make, replica, peak, knee, max_extra, gateway)
        wall = time.perf_counter() - t
    except ChatfleetError as e:
        _fail(e)
    from rich.table import Table

    table = Table(title=f"{peak} peak chats on simulated {g.name} replicas (knee {knee:g} each), {routing} routing")
    for col in ("replicas", "SLO", "busiest / mean requests", "shed", "affinity broken"):
        table.add_column(col)
    for tr in sizing.trials:
        table.add_row(str(tr.replicas), "met" if tr.passed else "broken", f"{tr.imbalance:.2f}", str(tr.shed),
                      str(tr.affinity_broken))
    out.print(table)
    needed = "more than tried" if sizing.needed is None else str(sizing.needed)
    out.print(f"peak / chats per replica = {sizing.naive}; needed under the gateway's routing: {needed}"
              + ("" if sizing.extra is None else f" ({sizing.extra:+d})") + f"  ({wall:.1f} s of wall time)")


def plan_host_tier(model: str = O_MODEL, gpu: str = O_GPU, catalog: Path | None = O_CATALOG, weights: str = O_WEIGHTS,
                   kv: str = O_KV, memory_fraction: float | None = O_FRACTION, budget: str | None = O_BUDGET,
                   kv_cache_memory: str | None = O_KVMEM, kv_cache_tokens: int | None = O_KVTOK,
                   max_running: int = O_CAP, max_batched_tokens: int = O_TOKENS, profile: str = O_PROFILE,
                   slo: str = O_SLO, duration: float = O_DURATION, warmup: float = O_WARMUP, seed: int = O_SEED,
                   level: float = typer.Option(..., "--level", help="Live chats (closed loop) to hold."),
                   sizes: str = typer.Option("0,1GiB,2GiB,4GiB,8GiB,16GiB,32GiB", "--sizes", help="Host-tier sizes."),
                   check_contents: bool = O_CHECK, token_scale: int = O_SCALE) -> None:
    """Returning turns' hit rate by host-tier size: where it stops improving."""
    from chatfleet.plan.host_sweep import sweep_host_sizes
    from chatfleet.plan.memory_report import read_model_config
    from chatfleet.plan.sim_bench import sim_protocol

    try:
        g, s, _ = replica_from_options(model, gpu, catalog, weights, kv, memory_fraction, budget, kv_cache_memory,
                                       kv_cache_tokens, "0", max_running, max_batched_tokens, check_contents)
        cfg, _ = read_model_config(model)
        proto = sim_protocol(LoadSpec("closed", level, duration_s=duration, warmup_s=warmup), parse_slo(slo), 1, seed)
        make, _ = WorkloadSource(get_profile(profile)).factory()
        byte_sizes = [parse_memory_size(x) if x.strip() not in ("0", "") else 0 for x in sizes.split(",")]
        res = sweep_host_sizes(proto, level, make, cfg, g, s, byte_sizes, fast=not check_contents,
                               token_scale=token_scale)
    except ChatfleetError as e:
        _fail(e)
    for p in res.points:
        hr = "-" if p.hit_rate is None else f"{p.hit_rate:.1%}"
        ttft = "-" if p.ttft_p99 is None else f"{p.ttft_p99 * 1e3:.0f} ms"
        out.print(f"host {_size(p.host_bytes):>10}: returning-turn hit rate {hr}, ttft p99 {ttft},"
                  f" SLO {'met' if p.passed else 'broken'}", highlight=False)
    plateau = res.plateau_bytes
    out.print("hit rate still improving at the largest size" if plateau is None else
              f"hit rate stops improving at {_size(plateau)} of host tier", highlight=False)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def plan_calibrate(result: Path = typer.Argument(..., help="A `chatfleet sweep` result measured against the engine."),
                   model: str = O_MODEL, gpu: str = O_GPU, catalog: Path | None = O_CATALOG, weights: str = O_WEIGHTS,
                   kv: str = O_KV, memory_fraction: float | None = O_FRACTION, budget: str | None = O_BUDGET,
                   kv_cache_memory: str | None = O_KVMEM, kv_cache_tokens: int | None = O_KVTOK, host: str = O_HOST,
                   max_running: int = O_CAP, max_batched_tokens: int = O_TOKENS,
                   series: str | None = typer.Option(None, "--series",
                                                     help="Which series of the result (default: the first)."),
                   out_catalog: Path = typer.Option(
                       ..., "--out", help="Write the calibrated GPU entry here (a catalog for --catalog)."),
                   ) -> None:
    """Fit the GPU's efficiency factors to one measured sweep (give the engine config it ran with)."""
    import yaml

    from chatfleet.bench.report import load_result
    from chatfleet.plan.calibrate import fit_efficiency, read_measured
    from chatfleet.plan.memory_report import read_model_config
    from chatfleet.plan.replica_setup import replica_plan
    from chatfleet.plan.sim_bench import sim_protocol, simulate_levels

    try:
        measured = read_measured(load_result(result), series)
        g, s, _ = replica_from_options(model, gpu, catalog, weights, kv, memory_fraction, budget, kv_cache_memory,
                                       kv_cache_tokens, host, max_running, max_batched_tokens, False)
        cfg, _ = read_model_config(model)
        proto = sim_protocol(LoadSpec(measured.mode, 1, duration_s=measured.duration_s, warmup_s=measured.warmup_s),
                             parse_slo(measured.slo))
        make, _ = WorkloadSource(get_profile(measured.profile), measured.tokenizer).factory()
        t = time.perf_counter()
        fit = fit_efficiency(measured, lambda e: simulate_levels(proto, measured.levels, make,
                                                                 replica_plan(cfg, g, s, efficiency=e)), g.efficiency)
        wall = time.perf_counter() - t
    except ChatfleetError as e:
        _fail(e)
    from rich.table import Table

    table = Table(title=f"calibration of {g.name} on {result} ({fit.evaluations} candidates, {wall:.0f} s)")
    for col in ("load", "itl p50 measured", "simulated", "itl p90 measured", "simulated", "ttft p50 measured",
                "simulated"):
        table.add_column(col)
    for level in measured.levels:
        m, sim = measured.metrics[level], fit.simulated.get(level, {})
        row = [f"{level:g}"]
        for key in ("itl_p50", "itl_p90", "ttft_p50"):
            row += [f"{m.get(key, float('nan')) * 1e3:.1f} ms", f"{sim.get(key, float('nan')) * 1e3:.1f} ms"]
        table.add_row(*row)
    out.print(table)
    eff = fit.efficiency
    out.print(f"efficiency: compute {eff.compute:.3g}, memory {eff.memory:.3g}, "
              f"step overhead {eff.step_overhead_ms:.3g} ms (rms log error {fit.error ** 0.5:.3f})")
    entry = g.with_efficiency(eff).to_yaml_entry()
    entry["source"] = f"{g.source}; efficiencies calibrated on {result.name}"
    out_catalog.write_text(yaml.safe_dump({"gpus": {g.name: entry}}, sort_keys=False))
    out.print(f"catalog: {out_catalog} (use with --catalog)")


def register(plan_app: typer.Typer) -> None:
    """Add the simulated commands to the `plan` group."""
    plan_app.command("sweep")(plan_sweep)
    plan_app.command("fleet")(plan_fleet)
    plan_app.command("host-tier")(plan_host_tier)
    plan_app.command("calibrate")(plan_calibrate)
