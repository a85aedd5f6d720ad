"""Chats per memory budget by precision: 32-bit, bf16, FP8 KV, FP8 KV + FP8 weights, and vLLM.

One memory budget for weights plus KV (default: the bf16 model's weights plus 2,048 tokens of
bf16 KV, so memory binds). For each configuration ``plan/memory.py`` (the engine's own
arithmetic) gives the weights' bytes and the KV pool the rest buys; the engine is started with
that ``--kv-cache-memory`` through the bench's launcher (``chatfleet.bench.servers``), then
measured side by side in one run: output tokens/s at 1, 8 and 32 closed-loop streams, and the
knee (the most concurrent chats inside the SLO) on the ``long-session`` profile, swept by the
bench's own sweep. vLLM's CPU build runs with ``--kv-cache-dtype fp8`` and bf16 weights at the
same budget (it has no CPU path for FP8 block-quantized weights).

Why this budget: on ``small`` the weights dominate (bf16: 60 MiB; KV: 4 KiB a token), so a
budget of bf16 weights plus 2,048 tokens makes the KV pool what binds for bf16: its knee is
where the long-session chats (400-1,500 tokens each) stop fitting and the prefix-cache hit
rate falls (each point's hit rate, TTFT and ITL p95 are printed and kept in the JSON). FP8
weights free 23 MiB of that budget for KV, so FP8 KV + weights holds ~7.7x the tokens and
becomes compute-bound instead. 32-bit weights alone exceed the budget: that row says so.

Activations: every configuration computes in bfloat16. On CPUs with AVX512-BF16 (this one)
bf16 is the fast dtype, and it is what a serving engineer would pick for FP8 weights too:
``runner_step.py --dtype float32 --kv-cache-dtype fp8 --quantization fp8`` is a little faster
at batch 1 but slower from batch 8 on (the batches a knee is made of), and bf16 KV/weights
in the bf16 row make the comparison one of storage precision alone.

    PYTHONPATH=src python benchmarks/precision.py [--model small] [--budget-mib N] [--skip-vllm]

Prints a table; writes benchmarks/results/precision.json. The machine is shared: compare
ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from chatfleet.bench.client import ClientConfig
from chatfleet.bench.dists import make
from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.servers import SeriesSpec, start_server
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.sources import WorkloadSource, run_async
from chatfleet.bench.sweep import Bench, RunProtocol, SweepSpec, sweep
from chatfleet.bench.workload import get_profile
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.sizing.memory import MemoryBreakdown, memory_breakdown
from chatfleet.errors import ConfigError

try:
    from common import RESULTS_DIR
except ImportError:
    from benchmarks.common import RESULTS_DIR

MIB = 2**20


@dataclass(frozen=True)
class Precision:
    name: str
    dtype: str
    kv: str = "auto"
    quantization: str | None = None
    embedding_dtype: str = "auto"
    vllm: bool = False
    run: bool = True  # False: pool arithmetic only

    def engine_flags(self) -> tuple[str, ...]:
        flags = ["--dtype", self.dtype, "--kv-cache-dtype", self.kv]
        if self.kv == "fp8":
            flags += ["--kv-scales-from-prompts", "512"]
        if self.quantization:
            flags += ["--quantization", self.quantization]
        if self.embedding_dtype != "auto":
            flags += ["--embedding-dtype", self.embedding_dtype]
        return tuple(flags)


PRECISIONS = (
    Precision("fp32", "float32"),
    Precision("bf16", "bfloat16"),
    Precision("fp8-kv", "bfloat16", kv="fp8"),
    Precision("fp8-kv+weights", "bfloat16", kv="fp8", quantization="fp8"),
    Precision("fp8 all (+embedding)", "bfloat16", kv="fp8", quantization="fp8", embedding_dtype="fp8", run=False),
    Precision("vLLM fp8-kv", "bfloat16", kv="fp8", vllm=True),
)


def breakdown(config: dict, p: Precision, budget: int) -> MemoryBreakdown | str:
    try:
        return memory_breakdown(config, dtype=p.dtype, quantization=p.quantization, embedding_dtype=p.embedding_dtype,
                                kv_cache_dtype=p.kv, budget_bytes=budget)
    except ConfigError as e:
        return e.message


def point_summary(p) -> dict:
    """One sweep point: pass/fail, each interval's mean (goodput, hit rate, SLO values) and the
    requests that finished ok out of all measured ones."""
    runs = p.kept
    return {"level": p.level, "passed": p.passed,
            **{k: round(v.mean, 4) for k, v in p.intervals.items()},
            "ok": sum(r.summary.ok for r in runs), "requests": sum(r.summary.requests for r in runs)}


def measure(series: SeriesSpec, args, log_dir: Path) -> dict:
    """Output tok/s at each stream count, then the knee on the long-session profile."""
    slo = parse_slo(args.slo)
    out: dict = {}
    with start_server(series, log_dir) as url:
        profile = get_profile(args.profile)
        # Streams: no pauses between turns, 64-token replies (each stream always has a request in flight).
        streaming = profile.with_overrides(think_time_s=make("const", value=0.0), reply_tokens=make("const", value=64))
        make_streams, _ = WorkloadSource(streaming, args.model).factory()
        make_chats, _ = WorkloadSource(profile, args.model).factory()

        async def go() -> None:
            load = LoadSpec("closed", 1, duration_s=args.duration, warmup_s=args.warmup)
            proto = RunProtocol(url, load, slo, repeats=1, server_kind=series.server_kind, use_gpu_telemetry=False)
            streams_bench = Bench(proto, ClientConfig(model=series.request_model), make_streams)
            bench = Bench(proto, ClientConfig(model=series.request_model), make_chats)
            try:
                tps = {}
                for streams in args.streams:
                    run = await streams_bench.run_once(streams, 0)
                    tps[str(streams)] = round(run.summary.output_tokens_per_s, 1)
                    print(f"  {series.name}: {streams} streams: {tps[str(streams)]} tok/s"
                          f" ({run.summary.ok}/{run.summary.requests} ok)", flush=True)
                out["output_tokens_per_s"] = tps
                result = await sweep(bench, SweepSpec(args.knee_start, args.knee_max, 2.0, 1.0, args.knee_points))
                out["knee"] = result.knee
                out["knee_reached"] = result.knee_reached
                out["points"] = [point_summary(p) for p in result.points]
                for p in out["points"]:
                    print(f"    {p}", flush=True)
                print(f"  {series.name}: knee {result.knee} chats"
                      f"{'' if result.knee_reached else ' (sweep ceiling)'}", flush=True)
            finally:
                await bench.close()
                await streams_bench.close()

        run_async(go())
    return out


def knee_text(row: dict) -> str:
    """The knee as the table shows it: ``>=N`` where the sweep reached its ceiling still inside the SLO."""
    knee = row.get("knee")
    if knee is None:
        return "-"
    return f"{'>=' if not row.get('knee_reached', True) else ''}{knee:g}"


def _knee_ratio(row: dict, knee_x: float | None) -> str:
    """The knee over the first row's, ">=" where the sweep never broke the SLO."""
    if not knee_x:
        return "-"
    return ("" if row.get("knee_reached", True) else ">=") + f"{knee_x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--budget-mib", type=float, default=None,
                    help="weights + KV budget (default: bf16 weights + 2048 tokens of bf16 KV)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", default="long-session")
    ap.add_argument("--slo", default="ttft_p95<=1s,itl_p95<=200ms")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--knee-start", type=int, default=2)
    ap.add_argument("--knee-max", type=int, default=64)
    ap.add_argument("--knee-points", type=int, default=5)
    ap.add_argument("--only", default=None, help="comma-separated precision names to run")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-python", type=Path, default=None,
                    help="vLLM CPU interpreter (default: benchmarks/.venv-vllm of this checkout)")
    args = ap.parse_args()
    folder = resolve_model(args.model)
    config = json.loads((folder / "config.json").read_text())
    bf16 = memory_breakdown(config, dtype="bfloat16", kv_cache_tokens=2048)
    budget = int(args.budget_mib * MIB) if args.budget_mib else bf16.weight_bytes + bf16.kv_pool_bytes
    log_dir = RESULTS_DIR / "logs" / time.strftime("precision-%Y%m%d-%H%M%S")
    print(f"model {args.model}; budget for weights + KV: {budget / MIB:.1f} MiB; profile {args.profile};"
          f" SLO {args.slo}; {args.threads} thread(s)")
    rows = []
    for p in PRECISIONS:
        b = breakdown(config, p, budget)
        row: dict = {"precision": p.name, "engine": "vLLM CPU" if p.vllm else "chatfleet",
                     "flags": list(p.engine_flags())}
        if isinstance(b, str):
            row["does_not_fit"] = b
            rows.append(row)
            print(f"{p.name}: does not fit: {b}")
            continue
        row.update(weight_mib=round(b.weight_bytes / MIB, 2), kv_mib=round(b.kv_pool_bytes / MIB, 2),
                   pool_tokens=b.pool_tokens, kv_bytes_per_token=b.kv_bytes_per_token)
        wanted = args.only is None or p.name in args.only.split(",")
        if p.run and wanted and not (p.vllm and args.skip_vllm):
            max_len = min(b.pool_tokens, 2048)  # long-session prompts stay under 1,600 tokens
            kv_bytes = budget - b.weight_bytes
            if p.vllm:
                series = SeriesSpec.vllm("vllm-fp8", folder, kv_bytes, max_len, args.threads, args.vllm_python,
                                         dtype=p.dtype)
                series = SeriesSpec(series.name, series.kind, series.model, series.args + ("--kv-cache-dtype", "fp8"),
                                    series.threads, series.request_model, series.env, series.python)
                row["note"] = "bf16 weights (vLLM's CPU build has no FP8 block-quantized linear); KV bytes as ours"
            else:
                series = SeriesSpec(p.name.replace(" ", "_"), "chatfleet", args.model,
                                    (*p.engine_flags(), "--kv-cache-memory", str(kv_bytes),
                                     "--max-model-len", str(max_len)), args.threads, args.model)
            print(f"{p.name}: {b.weight_bytes / MIB:.1f} MiB weights, {b.pool_tokens:,} tokens of KV", flush=True)
            try:
                row.update(measure(series, args, log_dir))
            except Exception as e:  # a server that refuses the configuration: say so, go on
                row["error"] = f"{type(e).__name__}: {e}"[:500]
                print(f"  {p.name}: failed: {row['error']}", flush=True)
        rows.append(row)
    base = next((r for r in rows if r["precision"] == "bf16"), {})
    print(f"\n{'precision':<22}{'weights MiB':>12}{'KV tokens':>11}{'x bf16':>8}"
          + "".join(f"{f'tok/s@{s}':>11}" for s in args.streams) + f"{'knee':>7}{'x bf16':>8}")
    for r in rows:
        if "does_not_fit" in r:
            print(f"{r['precision']:<22}  does not fit in the budget")
            continue
        pool_x = r["pool_tokens"] / base["pool_tokens"] if base.get("pool_tokens") else float("nan")
        tps = r.get("output_tokens_per_s", {})
        knee = r.get("knee")
        knee_x = knee / base["knee"] if knee is not None and base.get("knee") else None
        print(f"{r['precision']:<22}{r['weight_mib']:>12.1f}{r['pool_tokens']:>11,}{pool_x:>8.2f}"
              + "".join(f"{tps.get(str(s), float('nan')):>11.1f}" for s in args.streams)
              + f"{knee_text(r):>7}{_knee_ratio(r, knee_x):>8}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / "precision.json"
    path.write_text(json.dumps({"model": args.model, "budget_bytes": budget, "profile": args.profile,
                                "slo": args.slo, "threads": args.threads, "rows": rows}, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
