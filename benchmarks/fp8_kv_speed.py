"""Attention's reads of an FP8 KV cache against a cache of the model's dtype, kernel by kernel, in
the same run.

An FP8 (e4m3) cache holds twice the tokens in the same memory; it pays only if reading it costs
no more than reading the 16-bit cache. Over one layer's shapes (``small``: 8 query heads, 2 kv
heads of 64, blocks of 16 scattered through the pool) and ``--layers`` layers per step:

- decode: ``--batch`` single-token queries over ``--context`` cached tokens each, through the C++
  kernel over the model-dtype cache, the C++ kernel over the FP8 cache (rows widened in the
  kernel), and the torch-op path over the FP8 cache (what FP8 ran before the kernel took it);
- prefill context: the blocks of one ``--chunk-context``-token sequence as a chunk attention
  kernel reads them: gathered (model dtype), gathered and widened in one C++ pass (FP8), and
  gathered then dequantized by torch ops (FP8, before).

Median of ``--repeats`` timings of ``--iters`` calls each, one thread.

    python benchmarks/fp8_kv_speed.py                    # bf16 where native, else float32
    python benchmarks/fp8_kv_speed.py --dtype float32 --batch 8

Prints a table and writes benchmarks/results/fp8_kv_speed-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chatfleet.engine.models import paged_decode_cpu as pdc  # noqa: E402
from chatfleet.engine.models.decode_attention import build_decode_groups, decode_attention  # noqa: E402
from chatfleet.engine.models.kv_cache import dequantize_fp8, quantize_fp8  # noqa: E402
from chatfleet.engine.models.workspace import Workspace, gather_blocks  # noqa: E402
from machine import default_dtypes, describe_machine, load_average  # noqa: E402  (same folder)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 64, 16


def timed(fn: Callable[[], object], iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean ms of ``iters`` calls (after one warm-up call)."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 where native)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=500, help="cached tokens per decode")
    p.add_argument("--chunk-context", type=int, default=5500, help="cached tokens a prefill chunk reads")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    dtype_name = args.dtype or default_dtypes()[-1]
    dtype = getattr(torch, dtype_name)
    if not pdc.available():
        raise SystemExit("the C++ kernel does not build here: nothing to compare")
    torch.set_num_threads(1)
    start_load = load_average()

    gen = torch.Generator().manual_seed(0)
    lens = [args.context] * args.batch
    per_seq = -(-max(args.context, args.chunk_context) // BLOCK)
    num_blocks = per_seq * (args.batch + 1) + 8
    shape = (KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    key = (torch.randn(shape, generator=gen) * 2).to(dtype)
    value = torch.randn(shape, generator=gen).to(dtype)
    k_scale, v_scale = float(key.float().abs().amax()) / 448, float(value.float().abs().amax()) / 448
    key8, value8 = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)
    width = -(-args.context // BLOCK)
    tables = [order[i * width : (i + 1) * width] for i in range(args.batch)]
    padded = torch.tensor(tables, dtype=torch.long)
    ctx = torch.tensor(lens, dtype=torch.long)
    q = torch.randn(args.batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    groups = build_decode_groups(lens, tables, BLOCK, "cpu")
    ws = Workspace()
    scale = HEAD_DIM**-0.5
    layers = args.layers

    def decode(k: torch.Tensor, v: torch.Tensor, ks: float = 1.0, vs: float = 1.0) -> Callable[[], None]:
        def run() -> None:
            for _ in range(layers):
                pdc.paged_decode(q, k, v, padded, ctx, scale, k_scale=ks, v_scale=vs)
        return run

    def decode_torch_ops() -> None:
        for _ in range(layers):
            decode_attention(q, key8, value8, groups, ws, scale, k_scale, v_scale)

    ids = torch.tensor(order[: -(-args.chunk_context // BLOCK)], dtype=torch.long)

    def gather_model() -> None:
        for _ in range(layers):
            gather_blocks(key, ids, ws, "k")
            gather_blocks(value, ids, ws, "v")

    widened = (KV_HEADS, len(ids), BLOCK, HEAD_DIM)

    def gather_fp8_cpp() -> None:
        for _ in range(layers):
            pdc.gather_fp8(key8, ids, k_scale, dtype, ws.get("kd", widened, dtype, key.device))
            pdc.gather_fp8(value8, ids, v_scale, dtype, ws.get("vd", widened, dtype, key.device))

    def gather_fp8_torch() -> None:
        for _ in range(layers):
            for cache, s, n in ((key8, k_scale, "k8"), (value8, v_scale, "v8")):
                raw = gather_blocks(cache, ids, ws, n)
                dequantize_fp8(raw, s, dtype, ws.get(n + "d", tuple(raw.shape), dtype, raw.device))

    cases = [
        ("decode", f"C++ kernel, {dtype_name} cache", decode(key, value)),
        ("decode", "C++ kernel, FP8 cache", decode(key8, value8, k_scale, v_scale)),
        ("decode", "torch ops, FP8 cache", decode_torch_ops),
        ("prefill context", f"gather, {dtype_name} cache", gather_model),
        ("prefill context", "gather + widen in C++, FP8 cache", gather_fp8_cpp),
        ("prefill context", "gather + dequantize (torch), FP8 cache", gather_fp8_torch),
    ]
    rows = [{"what": what, "path": path, "ms_per_step": timed(fn, args.iters, args.repeats)}
            for what, path, fn in cases]
    for row in rows:
        base = next(r for r in rows if r["what"] == row["what"])
        row["vs_model_dtype"] = row["ms_per_step"] / base["ms_per_step"]

    out = Console()
    table = Table(title=f"FP8 KV reads, {dtype_name}, {layers} layers, one thread: decode b{args.batch} x "
                        f"{args.context} tokens; prefill context {args.chunk_context} tokens")
    for col in ("what", "path", "ms a step", f"x {dtype_name} cache"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["what"], r["path"], f"{r['ms_per_step']:.3f}", f"{r['vs_model_dtype']:.2f}")
    out.print(table)
    result = {"benchmark": "fp8_kv_speed", "dtype": dtype_name, "args": {k: str(v) for k, v in vars(args).items()},
              "machine": describe_machine(threads_used=1), "load_average": {"start": start_load, "end": load_average()},
              "rows": rows}
    path = args.out or RESULTS_DIR / f"fp8_kv_speed-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    out.print(f"wrote {path}")


if __name__ == "__main__":
    main()
