"""How fast each of a model's linears runs as a prompt step's product, per backend, one thread.

A prompt step is mostly products (`profile_step.py`: linears ~64% of the average step of
`engine_throughput.py`'s 32-stream phase), and those run at the CPU's peak in any engine that calls
a good GEMM, so they bound what a faster engine can win on prompt-heavy phases (`phase_split.py`).
This times every distinct linear of the model (the fused q/k/v, o, the fused gate/up, down, the
LM head) at each `--rows` count through oneDNN with the weight prepacked (what the engine's
`models/linear.py` runs) and through `F.linear` (MKL for float32 on CPU, which takes its AVX2
path on AMD CPUs), and reports GFLOP/s against a 2,048^3 product's (`cpu_floor.matmul_peak`).

    python benchmarks/product_rates.py                       # float32, plus bf16 where native
    python benchmarks/product_rates.py --dtypes float32 --rows 2048 512 32

Prints a table and writes benchmarks/results/product_rates-<time>.json (with the machine). Run
it under the measurement lock like every timing script.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chatfleet.engine.builtin_models.tiny import resolve_model  # noqa: E402
from chatfleet.engine.models.checkpoint import read_hf_config  # noqa: E402
from chatfleet.engine.models.qwen3 import Qwen3Config  # noqa: E402
from common import RESULTS_DIR  # noqa: E402  (same folder)
from cpu_floor import matmul_peak  # noqa: E402
from machine import default_dtypes, describe_machine, load_average  # noqa: E402


def linear_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, int]]:
    """(out, in) of each distinct linear the engine runs for a Qwen3 model (fused as it fuses them)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (q + 2 * kv, cfg.hidden_size), "o": (cfg.hidden_size, q),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
            "down": (cfg.hidden_size, cfg.intermediate_size), "lm_head": (cfg.vocab_size, cfg.hidden_size)}


def seconds_per_call(fn: Callable[[], torch.Tensor], min_seconds: float) -> float:
    """Median over batches of calls filling `min_seconds` in all, after two warm-up calls."""
    fn(), fn()
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_seconds or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtypes", default=",".join(default_dtypes()))
    ap.add_argument("--rows", type=int, nargs="+", default=[2048, 512])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=1.0, help="timing per linear and backend")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = Qwen3Config.from_hf(read_hf_config(resolve_model(args.model)))
    shapes = linear_shapes(cfg)
    machine = describe_machine(args.threads)
    result: dict = {"benchmark": "product_rates", "args": vars(args), "machine": machine,
                    "load_average_at_start": load_average(), "dtypes": {}}
    console = Console()
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        peak = matmul_peak(dtype)
        table = Table(title=f"{args.model} linears, {name}, {args.threads} thread(s), {machine['cpu_model']}; "
                            f"2,048^3 peak {peak / 1e9:.0f} GFLOP/s")
        for col in ("linear (out x in)", "rows", "oneDNN prepacked GFLOP/s", "of peak", "F.linear GFLOP/s",
                    "oneDNN ms"):
            table.add_column(col, justify="right")
        rows_out = []
        with torch.inference_mode():
            for rows in args.rows:
                for linear, (n, k) in shapes.items():
                    x = torch.randn(rows, k).to(dtype)
                    w = (torch.randn(n, k) * 0.05).to(dtype)
                    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                    flops = 2.0 * rows * n * k
                    onednn_s = seconds_per_call(lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise.default(
                        x, p, None, "none", [], ""), args.seconds)
                    plain_s = seconds_per_call(lambda x=x, w=w: F.linear(x, w), args.seconds)
                    row = {"linear": linear, "out": n, "in": k, "rows": rows,
                           "onednn_flops_per_s": flops / onednn_s, "f_linear_flops_per_s": flops / plain_s,
                           "onednn_ms": onednn_s * 1e3}
                    rows_out.append(row)
                    table.add_row(f"{linear} ({n} x {k})", str(rows), f"{flops / onednn_s / 1e9:.0f}",
                                  f"{flops / onednn_s / peak:.0%}", f"{flops / plain_s / 1e9:.0f}",
                                  f"{onednn_s * 1e3:.2f}")
        console.print(table)
        result["dtypes"][name] = {"peak_flops_per_s": peak, "rows": rows_out}
    result["load_average_at_end"] = load_average()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"product_rates-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
