"""Steps of ever-changing token counts with oneDNN's primitive cache as the engine sizes it (room
for every row bucket, ``engine/models/row_buckets.py``) against the 256 entries
``native_caches.py`` bounds it to, in the same run.

A serving engine's steps have a new token count nearly every time (prompt chunks of every length
beside the decodes). The model's row buckets turn those into ~100 row counts, each with its own
oneDNN primitives; a cache too small for all of them rebuilds them in turn. Each arm runs in a fresh
interpreter (oneDNN reads its capacity once): the runner (``small``, one thread) executes
``--steps`` prefills whose lengths are drawn from ``--min-tokens``..``--max-tokens`` (the same
draws in both arms), after one pass over every bucket, and reports the mean step time. Arms
alternate for ``--rounds``.

    python benchmarks/onednn_cache.py                   # bf16 where native, else float32
    python benchmarks/onednn_cache.py --dtype float32 --steps 300

Prints a table and writes benchmarks/results/onednn_cache-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chatfleet.native_caches import BOUND_MARK, CACHE_ENTRIES, ONEDNN_PRIMITIVE_CACHE  # noqa: E402
from machine import default_dtypes, describe_machine, load_average  # noqa: E402  (same folder)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ARMS = {"widened (engine)": None, f"bounded ({CACHE_ENTRIES})": str(CACHE_ENTRIES)}

CHILD = """
import json, os, random, sys, time
import torch
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.models import row_buckets
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.outputs import ScheduledChunk, SchedulerOutput
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.torch_runner import TorchRunner

dtype, steps, lo, hi, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(1)
loaded = load_model(resolve_model("small"), dtype=dtype)
blocks = -(-(hi + 64) // 16)
runner = TorchRunner(loaded, 4 * blocks, 16)
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
rng = random.Random(seed)


def step(i, n):
    tables = list(range((i % 4) * blocks, (i % 4 + 1) * blocks))
    runner.execute(SchedulerOutput([ScheduledChunk(f"r{i}", [rng.randrange(7000) for _ in range(n)], 0, tables,
                                                   True, params, 0)]))
    runner.execute(SchedulerOutput([], finished_request_ids=[f"r{i}"]))


counts = sorted({row_buckets.padded_rows(t) for t in range(lo, hi + 1)})
for i, n in enumerate(counts):  # every bucket once: what is left is the cache's doing
    step(i, n)
draw = random.Random(seed + 1)
lengths = [draw.randint(lo, hi) for _ in range(steps)]
t0 = time.perf_counter()
for i, n in enumerate(lengths):
    step(i, n)
wall = time.perf_counter() - t0
print(json.dumps({"mean_step_ms": wall / steps * 1e3, "tokens_per_s": sum(lengths) / wall,
                  "buckets": len(counts), "capacity": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="Default: bfloat16 where the CPU has it natively, else float32.")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--min-tokens", type=int, default=33)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def run_arm(capacity: str | None, args: argparse.Namespace, dtype: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (ONEDNN_PRIMITIVE_CACHE, BOUND_MARK)}
    if capacity is not None:  # set by hand: the engine keeps it
        env[ONEDNN_PRIMITIVE_CACHE] = capacity
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-c", CHILD, dtype, str(args.steps), str(args.min_tokens),
                          str(args.max_tokens), str(args.seed)], env=env, capture_output=True, text=True,
                         timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = args.dtype or default_dtypes()[-1]
    con = Console()
    load_at_start = load_average()
    runs: dict[str, list[dict]] = {name: [] for name in ARMS}
    for r in range(args.rounds):
        for name, capacity in ARMS.items():
            res = run_arm(capacity, args, dtype)
            runs[name].append(res)
            con.print(f"round {r}: {name}: {res['mean_step_ms']:.1f} ms a step (capacity {res['capacity']})")
    table = Table(title=f"small {dtype}, {args.steps} prefills of {args.min_tokens}-{args.max_tokens} tokens, 1 thread")
    for c in ("oneDNN cache", "mean step ms (median of rounds)", "prompt tok/s", "per round"):
        table.add_column(c, justify="right")
    summary = {}
    for name, rs in runs.items():
        ms = statistics.median(r["mean_step_ms"] for r in rs)
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        summary[name] = {"mean_step_ms": ms, "tokens_per_s": tps}
        table.add_row(name, f"{ms:.1f}", f"{tps:,.0f}", " / ".join(f"{r['mean_step_ms']:.1f}" for r in rs))
    con.print(table)
    speedup = summary[f"bounded ({CACHE_ENTRIES})"]["mean_step_ms"] / summary["widened (engine)"]["mean_step_ms"]
    con.print(f"widened vs bounded: {speedup:.2f}x the step rate")
    doc = {"benchmark": "onednn_cache", "created_unix": time.time(), "argv": sys.argv[1:], "dtype": dtype,
           "machine": describe_machine(1), "load_average": {"start": load_at_start, "end": load_average()},
           "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "runs": runs, "summary": summary, "widened_over_bounded": speedup}
    RESULTS_DIR.mkdir(exist_ok=True)
    out = args.out or RESULTS_DIR / time.strftime("onednn_cache-%Y%m%d-%H%M%S.json")
    out.write_text(json.dumps(doc, indent=2))
    con.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
