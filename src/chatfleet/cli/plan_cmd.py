"""`chatfleet plan ...`: memory arithmetic and capacity prediction for GPUs you do not have."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from chatfleet.cli import plan_sim_cmd
from chatfleet.cli.plan_output import O_CATALOG, out
from chatfleet.cli.plan_output import fail as _fail
from chatfleet.engine.config import parse_memory_size
from chatfleet.errors import ChatfleetError

plan_app = typer.Typer(help="Memory math and capacity prediction for GPUs you do not have.", no_args_is_help=True)


def _lengths(profile: str, lengths: str | None):
    from chatfleet.bench.workload import get_profile
    from chatfleet.errors import ConfigError
    from chatfleet.plan.capacity import lengths_from_mean_p95, lengths_from_profile

    if lengths is None:
        return lengths_from_profile(get_profile(profile))
    try:
        kv = dict(part.split("=", 1) for part in lengths.split(","))
        return lengths_from_mean_p95(float(kv["mean"]), float(kv["p95"]))
    except (KeyError, ValueError):
        raise ConfigError(f"--lengths must look like 'mean=5500,p95=9000', got {lengths!r}") from None


@plan_app.command("memory")
def memory_cmd(
    model: str = typer.Option(..., "--model", help="A model folder, its config.json, or 'tiny'/'small'."),
    gpu: str = typer.Option(..., "--gpu", help="GPU name from the catalog (e.g. L4, H100)."),
    weights: str = typer.Option("bf16", "--weights", help="bf16, fp16 or fp8 (an FP8 checkpoint stays FP8)."),
    kv: str = typer.Option("bf16", "--kv", help="KV cache dtype: bf16, fp16, fp32 or fp8."),
    memory_fraction: float | None = typer.Option(None, "--memory-fraction",
                                                 help="Share of the GPU's memory for the replica (default 0.9)."),
    budget: str | None = typer.Option(None, "--budget", help="Bytes for weights + KV cache (e.g. '20GiB')."),
    reserve: str = typer.Option("1GiB", "--reserve", help="With --memory-fraction: activations and runtime overhead."),
    host_cache: str = typer.Option("0", "--host-cache-memory", "--host-cache",
                                   help="Host-memory KV tier (e.g. '64GiB'; 0: none)."),
    block_size: int = typer.Option(16, "--block-size", help="KV block size in tokens."),
    profile: str = typer.Option("seed-roleplay", "--profile", help="Bench profile whose live-chat lengths to fit."),
    lengths: str | None = typer.Option(None, "--lengths", help="Instead of --profile: 'mean=5500,p95=9000'."),
    with_towers: bool = typer.Option(False, "--with-towers",
                                     help="Serve vision/audio towers too (default: text only)."),
    catalog: Path | None = O_CATALOG,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
) -> None:
    """Weights by tensor class, KV bytes per token per layer group, the pool, and chats that fit."""
    from chatfleet.plan.catalog import load_catalog
    from chatfleet.plan.memory_report import budget_for, memory_report, read_model_config

    try:
        g = load_catalog(catalog).get(gpu)
        cfg, _ = read_model_config(model)
        b = budget_for(g, memory_fraction, parse_memory_size(budget) if budget else None, parse_memory_size(reserve))
        report = memory_report(cfg, g, _lengths(profile, lengths), weights=weights, kv=kv, budget_bytes=b,
                               host_bytes=parse_memory_size(host_cache), block_size=block_size,
                               language_model_only=not with_towers)
    except ChatfleetError as e:
        _fail(e)
    if as_json:
        out.print_json(json.dumps(report.as_dict()))
    else:
        out.print(report.describe(), highlight=False, markup=False, soft_wrap=True)


@plan_app.command("gpus")
def gpus_cmd(catalog: Path | None = O_CATALOG) -> None:
    """List the GPU catalog (spec-sheet numbers, dense tensor rates)."""
    from rich.table import Table

    from chatfleet.plan.catalog import load_catalog

    try:
        cat = load_catalog(catalog)
    except ChatfleetError as e:
        _fail(e)
    t = Table(title="GPU catalog (spec sheets; dense, not sparse)")
    for col in ("GPU", "memory GB", "HBM GB/s", "BF16 TFLOPS", "FP8 TFLOPS", "PCIe GB/s", "P2P GB/s", "step costs"):
        t.add_column(col)
    for g in cat.gpus:
        t.add_row(g.name, f"{g.memory_bytes / 1e9:g}", f"{g.memory_bandwidth_gbps:g}", f"{g.bf16_tflops:g}",
                  f"{g.fp8_tflops:g}" if g.fp8_tflops else "-", f"{g.pcie_gbps:g}", f"{g.p2p_gbps:g}",
                  "calibrated" if g.calibration else "extrapolated")
    out.print(t)
    calibrated = [g for g in cat.gpus if g.calibration]
    for g in calibrated:
        out.print(f"{g.name}: {g.calibration}", highlight=False, markup=False)
    rest = ", ".join(g.name for g in cat.gpus if not g.calibration) or "none"
    out.print(f"calibrated on the card (benchmarks/gpu_check.sh): {len(calibrated)} of {len(cat.gpus)}; "
              f"extrapolated from spec sheets and catalog efficiencies: {rest}", highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    """Add the `plan` command group to `app`: the commands here, then the simulated ones
    (`plan sweep`, `fleet`, `host-tier`, `calibrate`)."""
    plan_sim_cmd.register(plan_app)
    app.add_typer(plan_app, name="plan")


@plan_app.command("prefixes")
def prefixes_cmd(
    requests: Path = typer.Argument(..., help="OpenAI chat requests, one JSON object a line."),
    model: str | None = typer.Option(None, "--model", help="Tokenize with this model's tokenizer and chat template"
                                     " (a folder, 'tiny' or 'small'; default: bytes with a ChatML template)."),
    block_size: int = typer.Option(16, "--block-size", help="KV block size of the engine."),
) -> None:
    """Shared prefix length, where requests diverge (and why), and the cache hit rate as sent vs fixed."""
    from chatfleet.plan.prefix_hits import engine_hit_rate
    from chatfleet.plan.prefixes import analyze, read_requests, render, shared_prefix

    try:
        if model is None:
            from chatfleet.engine.runner.sim_runner import make_byte_tokenizer

            tok = make_byte_tokenizer()
        else:
            from chatfleet.engine.builtin_models.tiny import resolve_model
            from chatfleet.engine.tokenizer import ChatTokenizer

            tok = ChatTokenizer.from_pretrained(resolve_model(model))
        reqs = read_requests(requests)
        found, fixed = analyze(reqs)
        sent = [render(tok, r) for r in reqs]
        repaired = [render(tok, r) for r in fixed]
        before, after = engine_hit_rate(sent, block_size), engine_hit_rate(repaired, block_size)
    except ChatfleetError as e:
        _fail(e)
    out.print(f"{len(reqs)} requests, {sum(map(len, sent)):,} prompt tokens", highlight=False, soft_wrap=True)
    out.print(f"shared prefix: {shared_prefix(sent):,} tokens as sent, {shared_prefix(repaired):,} with the"
              f" divergences fixed", highlight=False, soft_wrap=True)
    if not found:
        out.print("no divergence found among requests that should share a prefix", highlight=False, soft_wrap=True)
    for d in found:
        out.print(f"  {d.kind}: {d.description} ({d.requests} requests), e.g. {d.example!r}", highlight=False,
                  soft_wrap=True, markup=False)
    out.print(f"engine prefix-cache hit rate: {before.rate:.1%} as sent, {after.rate:.1%} fixed"
              f" ({before.cached_tokens:,} -> {after.cached_tokens:,} of {before.prompt_tokens:,} tokens)",
              highlight=False, soft_wrap=True)
