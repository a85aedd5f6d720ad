"""Gemma 4 on the built-in engine: memory split between layer groups, slid-out blocks, MoE vs
dense, the text-only load, and vLLM's CPU build on the same folder.

In one run, on the ``small-gemma4-moe`` model (sliding-window and full-attention layer groups,
each with its own pool):

- ``memory``: memory-bound capacity in logical time: the engine's scheduler and hybrid KV
  manager (no model: a step costs nothing, pauses count steps) run long-session chats in a
  closed loop at several levels, per memory split and slid-out setting; the knee is the most
  live chats whose prefix-cache hit rate stays above a target (what the pools, not the CPU, allow);
- ``knee``: chats within the SLO on the long-session profile at one device KV budget, for several
  splits of that budget between the sliding and the full pool (``--sliding-memory-fraction``;
  ``auto``: the spec's default) and with slid-out blocks kept cached or freed
  (``--keep-slid-out-blocks`` / ``--no-keep-slid-out-blocks``);
- ``tokens/s``: decode throughput of the MoE model against ``small-gemma4`` (dense, the same
  active feed-forward width), in process, side by side, at several batch sizes;
- ``text-only``: bytes a ``Gemma4ForConditionalGeneration`` folder's towers take and the
  language-model-only load leaves on disk (``small-gemma4-moe-mm``);
- ``vllm``: vLLM's CPU build swept on the same folder and budget, or the reason it does not serve it.

    python benchmarks/gemma4.py                                  # defaults: short sweeps, 1 thread
    python benchmarks/gemma4.py --sections tps,text --batches 1,8

Prints tables and writes benchmarks/results/gemma4-<time>.json. The machine is shared: numbers
are noisy, ratios are measured side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chatfleet.bench.demo import DemoConfig, sweep_series
from chatfleet.bench.report import write_json
from chatfleet.bench.servers import SeriesSpec
from chatfleet.bench.techniques import EngineArgs
from chatfleet.engine.config import CacheConfig, parse_memory_size

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SECTIONS = ("memory", "knee", "tps", "text", "vllm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"Comma-separated, from {', '.join(SECTIONS)}.")
    p.add_argument("--model", default="small-gemma4-moe")
    p.add_argument("--dense", default="small-gemma4", help="Dense model of the same active parameters.")
    p.add_argument("--multimodal", default="small-gemma4-moe-mm")
    p.add_argument("--profile", default="long-session")
    p.add_argument("--slo", default="ttft_p95<=3s,itl_p95<=500ms", help="Relaxed for a shared 2-core CPU.")
    p.add_argument("--kv-cache-memory", default="64MiB", help="Device KV budget of every knee series.")
    p.add_argument("--fractions", default="auto,0.5,0.7,0.85", help="Sliding-pool shares to sweep.")
    p.add_argument("--keep", default="on,off", help="Slid-out blocks kept cached (on) and/or freed (off).")
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--sim-kv-cache-memory", default="128MiB", help="KV budget of the logical-time runs.")
    p.add_argument("--sim-levels", default="4,8,16,32,48", help="Live chats of the logical-time runs.")
    p.add_argument("--sim-steps", type=int, default=3000)
    p.add_argument("--hit-target", type=float, default=0.8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--start", type=int, default=2)
    p.add_argument("--max-level", type=int, default=32)
    p.add_argument("--max-points", type=int, default=3)
    p.add_argument("--batches", default="1,8,32", help="Decode batch sizes for tokens/s.")
    p.add_argument("--tps-prompt", type=int, default=128)
    p.add_argument("--tps-tokens", type=int, default=24)
    p.add_argument("--tps-repeats", type=int, default=2)
    p.add_argument("--vllm-python", type=Path, default=None)
    p.add_argument("--vllm-max-model-len", type=int, default=2048,
                   help="vLLM sizes its pool for one request of this length (it refuses the budget otherwise).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


# ---- knee per memory split and slid-out setting ------------------------------------------------
def split_plan(model_dir: Path, budget: int, fraction: float | None, block_size: int = 16) -> dict:
    """The pools a split buys (the engine's own arithmetic)."""
    from chatfleet.engine.models.gemma4_config import Gemma4Config

    spec = Gemma4Config.from_hf(json.loads((model_dir / "config.json").read_text())).kv_cache_spec(block_size)
    plan = CacheConfig(block_size=block_size, memory_bytes=budget, sliding_memory_fraction=fraction).plan_pools(spec)
    return {p.group.name: {"blocks": p.num_blocks, "tokens": p.num_tokens, "bytes": p.num_bytes} for p in plan.pools}


def knee_section(args: argparse.Namespace, con: Console, run_dir: Path, model_dir: Path) -> dict:
    budget = parse_memory_size(args.kv_cache_memory)
    cfg = DemoConfig(model=str(model_dir), profile=args.profile, join="start", slo=args.slo, threads=args.threads,
                     duration_s=args.duration, warmup_s=args.warmup, start=args.start, max_level=args.max_level,
                     max_points=args.max_points, repeats=1, seed=args.seed, out_dir=run_dir)
    rows = {}
    for frac_s in [f.strip() for f in args.fractions.split(",") if f.strip()]:
        fraction = None if frac_s == "auto" else float(frac_s)
        for keep in [k.strip() for k in args.keep.split(",") if k.strip()]:
            name = f"split {frac_s}, slid-out {'kept' if keep == 'on' else 'freed'}"
            flags = ["--kv-cache-memory", str(budget), "--max-batched-tokens", str(args.max_batched_tokens),
                     "--keep-slid-out-blocks" if keep == "on" else "--no-keep-slid-out-blocks"]
            if fraction is not None:
                flags += ["--sliding-memory-fraction", str(fraction)]
            spec = SeriesSpec.chatfleet(name, str(model_dir), EngineArgs(tuple(flags), (), ()), args.threads)
            t0 = time.monotonic()
            try:
                res = sweep_series(cfg, spec, con)
            except Exception as e:  # reported, the others still run
                rows[name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
                continue
            pt = next((p for p in res.points if p.level == res.knee), None)
            rows[name] = {
                "fraction": frac_s, "keep_slid_out_blocks": keep == "on",
                "pools": split_plan(model_dir, budget, fraction),
                "knee": res.knee, "knee_reached": res.knee_reached,
                "goodput": pt.intervals["goodput"].mean if pt else None,
                "hit_rate": pt.intervals["hit_rate"].mean if pt and "hit_rate" in pt.intervals else None,
                "seconds": time.monotonic() - t0,
            }
            con.print(f"  {name}: knee {res.knee}")
    t = Table(title=f"knee on {args.profile}, KV budget {args.kv_cache_memory} ({args.model})")
    for c in ("series", "sliding pool", "full pool", "knee (chats)", "goodput/s", "hit rate"):
        t.add_column(c, justify="right")
    for name, r in rows.items():
        if "error" in r:
            t.add_row(name, "-", "-", "failed", "-", r["error"][:60])
            continue
        pools = r["pools"]
        knee = "none" if r["knee"] is None else f"{r['knee']:g}" + ("" if r["knee_reached"] else "+")
        t.add_row(name, f"{pools['sliding']['tokens']:,} tok", f"{pools['full']['tokens']:,} tok", knee,
                  "-" if r["goodput"] is None else f"{r['goodput']:.2f}",
                  "-" if r["hit_rate"] is None else f"{r['hit_rate']:.0%}")
    con.print(t)
    return {"budget_bytes": budget, "rows": rows}


# ---- memory-bound capacity in logical time (the real scheduler and KV manager, no model) --------
class _NoModel:
    """Samples a token per (request, position); the step costs nothing (time counts steps)."""

    def execute(self, out):
        from chatfleet.engine.outputs import RunnerOutput, SampledToken

        return RunnerOutput(sampled={c.request_id: SampledToken(hash((c.request_id, c.context_length)) % 5000)
                                     for c in out.chunks if c.sample})


def simulate(spec, plan, keep: bool, chats: int, profile, steps: int, seed: int, budget_tokens: int) -> dict:
    """``chats`` conversations in a closed loop (a finished one is replaced), pauses in steps."""
    import random

    from chatfleet.engine.config import SchedulerConfig
    from chatfleet.engine.kv.hybrid import HybridKVManager
    from chatfleet.engine.request import Request, SamplingParams
    from chatfleet.engine.scheduler import Scheduler

    kv = HybridKVManager(plan, keep_slid_out_blocks=keep)
    sched = Scheduler(SchedulerConfig(max_batched_tokens=min(budget_tokens, kv.max_step_tokens()), max_running=chats),
                      kv, max_model_len=kv.total_tokens)
    rng = random.Random(seed)
    runner = _NoModel()
    cards = [[rng.randrange(5000) for _ in range(profile.card_tokens.sample_int(rng))]
             for _ in range(profile.num_characters)]
    state: list[dict] = []
    counter = 0

    def new_chat() -> dict:
        nonlocal counter
        counter += 1
        card = cards[min(int(rng.paretovariate(max(profile.zipf_s, 0.1))) - 1, len(cards) - 1)]
        return {"id": counter, "history": list(card), "turns": profile.turns.sample_int(rng), "turn": 0,
                "wake": 0, "live": None}

    state = [new_chat() for _ in range(chats)]
    prompt = cached = turns = 0
    for step in range(steps):
        for c in state:
            if c["live"] is None and step >= c["wake"]:
                user = [rng.randrange(5000) for _ in range(profile.user_tokens.sample_int(rng))]
                tokens = c["history"] + user
                if len(tokens) + 20 > min(profile.max_prompt_tokens, kv.total_tokens):
                    c.update(new_chat())
                    continue
                n = profile.reply_tokens.sample_int(rng)
                r = Request(f"{c['id']}/{c['turn']}", tokens, SamplingParams(max_tokens=n, min_tokens=n,
                                                                             temperature=0.0, ignore_eos=True))
                sched.add_request(r)
                c["live"] = r
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        for c in state:
            r = c["live"]
            if r is not None and r.request_id not in sched.requests:
                prompt += r.num_prompt_tokens
                cached += max(r.num_cached_tokens, 0)
                turns += 1
                c["history"] = r.all_token_ids
                c["live"], c["turn"] = None, c["turn"] + 1
                c["wake"] = step + int(profile.think_time_s.sample(rng) * 10)  # 10 steps a second
                if c["turn"] >= c["turns"]:
                    c.update(new_chat())
    return {"turns": turns, "hit_rate": cached / prompt if prompt else None, "preemptions": sched.num_preemptions,
            "recomputed_tokens_per_turn": (prompt - cached) / turns if turns else None}


def memory_section(args: argparse.Namespace, con: Console, model_dir: Path) -> dict:
    from chatfleet.bench.workload import get_profile
    from chatfleet.engine.models.gemma4_config import Gemma4Config
    from chatfleet.errors import ConfigError

    budget = parse_memory_size(args.sim_kv_cache_memory)
    spec = Gemma4Config.from_hf(json.loads((model_dir / "config.json").read_text())).kv_cache_spec(16)
    profile = get_profile(args.profile)
    levels = [int(x) for x in args.sim_levels.split(",")]
    rows = {}
    for frac_s in [f.strip() for f in args.fractions.split(",") if f.strip()]:
        fraction = None if frac_s == "auto" else float(frac_s)
        plan = CacheConfig(memory_bytes=budget, sliding_memory_fraction=fraction).plan_pools(spec)
        for keep in (True, False):
            name = f"split {frac_s}, slid-out {'kept' if keep else 'freed'}"
            try:
                points = {n: simulate(spec, plan, keep, n, profile, args.sim_steps, args.seed, args.max_batched_tokens)
                          for n in levels}
            except ConfigError as e:
                rows[name] = {"error": e.message}
                continue
            ok = [n for n, p in points.items() if p["hit_rate"] is not None and p["hit_rate"] >= args.hit_target]
            rows[name] = {"fraction": frac_s, "keep": keep, "points": points, "knee": max(ok) if ok else None,
                          "pools": {p.group.name: p.num_tokens for p in plan.pools}}
    t = Table(title=f"memory-bound capacity, logical time ({args.profile}, KV {args.sim_kv_cache_memory}, "
                    f"knee: hit rate >= {args.hit_target:.0%})")
    t.add_column("series")
    t.add_column("pools (tokens)", justify="right")
    for n in levels:
        t.add_column(f"{n} chats", justify="right")
    t.add_column("knee", justify="right")
    for name, r in rows.items():
        if "error" in r:
            t.add_row(name, "-", *(["-"] * len(levels)), r["error"][:40])
            continue
        cells = [f"{p['hit_rate']:.0%} / {p['preemptions']}p" if p["hit_rate"] is not None else "-"
                 for p in r["points"].values()]
        pools = f"S {r['pools'].get('sliding', 0):,} F {r['pools'].get('full', 0):,}"
        t.add_row(name, pools, *cells, "-" if r["knee"] is None else str(r["knee"]))
    con.print(t)
    con.print("cells: prefix-cache hit rate / preemptions over the run")
    return {"budget_bytes": budget, "steps": args.sim_steps, "rows": rows}


# ---- MoE vs dense decode tokens/s ----------------------------------------------------------------
def _decode_tps(engine, batch: int, prompt_tokens: int, new_tokens: int, seed: int) -> float:
    import random

    from chatfleet.engine.request import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{seed}-{i}", [rng.randrange(10, engine.vocab_size) for _ in range(prompt_tokens)], params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (and the first token) outside the timed part
    t0, produced = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - t0)


def _params(hf_config: dict) -> dict[str, int]:
    """Total parameters and those one token uses (routed experts: top-k of them)."""
    from chatfleet.engine.sizing.memory import memory_breakdown

    text = hf_config.get("text_config") or hf_config
    m = memory_breakdown(hf_config, dtype="float32", language_model_only=True)
    total = sum(c.num_params for c in m.classes if not c.skipped)
    experts = sum(c.num_params for c in m.classes if c.tensor_class == "experts")
    share = (text["top_k_experts"] / text["num_experts"]) if text.get("enable_moe_block") else 1.0
    return {"total": total, "active": round(total - experts * (1 - share))}


def tps_section(args: argparse.Namespace, con: Console) -> dict:
    import torch

    from chatfleet.engine.config import EngineConfig, SchedulerConfig
    from chatfleet.engine.engine import Engine

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    engines = {}
    for name in (args.model, args.dense):
        engines[name] = Engine(EngineConfig(model=name, cache=CacheConfig(num_tokens=65536),
                                            scheduler=SchedulerConfig(max_batched_tokens=4096)))
    params = {n: _params(e.runner.loaded.hf_config) for n, e in engines.items()}
    results: dict[str, dict[int, list[float]]] = {n: {b: [] for b in batches} for n in engines}
    for rep in range(args.tps_repeats):  # alternate the models: drift hits both alike
        for b in batches:
            for n, e in engines.items():
                results[n][b].append(_decode_tps(e, b, args.tps_prompt, args.tps_tokens, seed=rep * 100 + b))
    t = Table(title=f"decode tokens/s, {args.threads} thread(s) (median of {args.tps_repeats})")
    t.add_column("batch", justify="right")
    for n in engines:
        t.add_column(n, justify="right")
    t.add_column("MoE / dense", justify="right")
    rows = {}
    for b in batches:
        med = {n: statistics.median(results[n][b]) for n in engines}
        ratio = med[args.model] / med[args.dense]
        rows[b] = {"tokens_per_s": med, "runs": {n: results[n][b] for n in engines}, "moe_over_dense": ratio}
        t.add_row(str(b), *(f"{med[n]:.1f}" for n in engines), f"{ratio:.2f}x")
    con.print(t)
    con.print("parameters (total / active per token): " + ", ".join(
        f"{n} {p['total'] / 1e6:.1f} M / {p['active'] / 1e6:.1f} M" for n, p in params.items()))
    return {"batches": rows, "parameters": params, "prompt_tokens": args.tps_prompt, "new_tokens": args.tps_tokens}


# ---- the text-only load ----------------------------------------------------------------------
def text_section(args: argparse.Namespace, con: Console) -> dict:
    from chatfleet.engine.builtin_models.tiny import resolve_model
    from chatfleet.engine.models.loader import load_model
    from chatfleet.engine.sizing.memory import memory_breakdown

    folder = resolve_model(args.multimodal)
    t0 = time.perf_counter()
    loaded = load_model(folder)
    seconds = time.perf_counter() - t0
    report = loaded.weight_report
    cfg = json.loads((folder / "config.json").read_text())
    served = memory_breakdown(cfg, dtype="float32", language_model_only=True)
    whole = memory_breakdown(cfg, dtype="float32", language_model_only=False)
    doc = {"folder": str(folder), "read_bytes": report.loaded_bytes, "skipped_bytes": report.skipped_bytes,
           "skipped_tensors": report.skipped_tensors, "skipped_prefixes": list(report.skipped_prefixes),
           "load_seconds": seconds, "breakdown_weight_bytes": served.weight_bytes,
           "breakdown_weight_bytes_with_towers": whole.weight_bytes}
    saved = report.skipped_bytes / (report.loaded_bytes + report.skipped_bytes)
    con.print(f"text-only load of {args.multimodal}: read {report.loaded_bytes / 2**20:.1f} MiB, left "
              f"{report.skipped_bytes / 2**20:.1f} MiB of {', '.join(report.skipped_prefixes)} on disk "
              f"({saved:.1%} of the checkpoint; breakdown: {whole.weight_bytes / 2**20:.1f} -> "
              f"{served.weight_bytes / 2**20:.1f} MiB), {seconds:.1f} s")
    return doc


# ---- vLLM on the same folder -----------------------------------------------------------------
def vllm_section(args: argparse.Namespace, con: Console, run_dir: Path, model_dir: Path) -> dict:
    budget = parse_memory_size(args.kv_cache_memory)
    pools = split_plan(model_dir, budget, None)
    try:
        max_len = min(args.vllm_max_model_len, pools["full"]["tokens"])
        spec = SeriesSpec.vllm("vllm", model_dir, budget, max_len + 128, args.threads, args.vllm_python)
    except Exception as e:
        con.print(f"vLLM: not run ({e})")
        return {"served": False, "reason": str(e)}
    cfg = DemoConfig(model=str(model_dir), profile=args.profile, join="start", slo=args.slo, threads=args.threads,
                     duration_s=args.duration, warmup_s=args.warmup, start=args.start, max_level=args.max_level,
                     max_points=args.max_points, repeats=1, seed=args.seed, out_dir=run_dir)
    try:
        res = sweep_series(cfg, spec, con)
    except Exception as e:
        log = run_dir / "server-vllm.log"
        tail = log.read_text(errors="replace")[-3000:] if log.is_file() else ""
        con.print(f"vLLM does not serve {model_dir.name}: {type(e).__name__}: {str(e)[:300]}")
        return {"served": False, "reason": f"{type(e).__name__}: {e}"[:2000], "log_tail": tail}
    pt = next((p for p in res.points if p.level == res.knee), None)
    con.print(f"vLLM on {model_dir.name}: knee {res.knee}")
    return {"served": True, "knee": res.knee, "knee_reached": res.knee_reached,
            "goodput": pt.intervals["goodput"].mean if pt else None, "args": list(spec.args)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    con = Console()
    from chatfleet.engine.builtin_models.tiny import resolve_model

    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; valid: {', '.join(SECTIONS)}")
    model_dir = resolve_model(args.model)
    run_dir = RESULTS_DIR / time.strftime("gemma4-%Y%m%d-%H%M%S")
    doc: dict = {"benchmark": "gemma4", "created_unix": time.time(), "argv": sys.argv[1:],
                 "settings": {k: str(v) for k, v in vars(args).items()}}
    if "memory" in sections:
        doc["memory"] = memory_section(args, con, model_dir)
    if "text" in sections:
        doc["text_only"] = text_section(args, con)
    if "tps" in sections:
        doc["tokens_per_s"] = tps_section(args, con)
    if "knee" in sections:
        doc["knee"] = knee_section(args, con, run_dir, model_dir)
    if "vllm" in sections:
        doc["vllm"] = vllm_section(args, con, run_dir, model_dir)
    out = write_json(doc, args.out or RESULTS_DIR / f"{run_dir.name}.json")
    con.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
