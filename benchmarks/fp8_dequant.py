"""FP8 (e4m3) weight and KV dequantization on CPU: the ways to do it, side by side in one run.

For every linear of one layer of the model (block-wise ``[128, 128]`` scales, as
``--quantization fp8`` stores them) and for one decode step's gathered K of a batch, the time of:

- ``torch .to()``: PyTorch's own element-by-element conversion, then the scales;
- ``float16 layout``: the bits placed as float16, then float32 and the target dtype, then the
  scales (``fp8_cast.fp8_to_down``: six passes, two of them 4 bytes wide);
- ``placed``: the bits placed straight into the target dtype, then one multiplication by the
  scales with the placement's power of two folded in (``fp8_cast.fp8_placed``: four passes);
- ``LUT gather``: a 256-entry table indexed by the codes (a widening pass plus a gather);

next to the layer's matrix products at batch 1 and 8 (what the dequantized weight is for). For
the KV cache, decodes fold the scale into the scores and the output (``placed, scale folded``).

    PYTHONPATH=src python benchmarks/fp8_dequant.py [--model small] [--dtype bfloat16] [--threads 1]

Prints a table; writes benchmarks/results/fp8_dequant.json. The machine is shared: compare the
ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.models.checkpoint import read_hf_config
from chatfleet.engine.models.fp8_cast import fp8_placed, fp8_to_down
from chatfleet.engine.models.fp8_format import FP8WeightFormat
from chatfleet.engine.models.fp8_linear import _scale_tiles, dequantize_weight, fold_scale, quantize_weight
from chatfleet.engine.models.qwen3 import Qwen3Config

try:
    from common import RESULTS_DIR
except ImportError:
    from benchmarks.common import RESULTS_DIR


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--kv-batch", type=int, default=8, help="decodes whose K one step gathers")
    ap.add_argument("--kv-context", type=int, default=800, help="tokens of context per decode")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    cfg = Qwen3Config.from_hf(read_hf_config(resolve_model(args.model)))
    fmt = FP8WeightFormat()
    q_rows = cfg.num_heads * cfg.head_dim
    kv_rows = cfg.num_kv_heads * cfg.head_dim
    shapes = {"qkv": (q_rows + 2 * kv_rows, cfg.hidden_size), "o": (cfg.hidden_size, q_rows),
              "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size)}
    layer = {name: quantize_weight(torch.randn(shape) * 0.02, fmt) for name, shape in shapes.items()}
    outs = {name: torch.empty(shape, dtype=dtype) for name, shape in shapes.items()}
    folded = {name: fold_scale(s, dtype) for name, (_, s) in layer.items()}
    lut = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(dtype)

    def each(convert: Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], object]) -> Callable[[], None]:
        def run() -> None:
            for name, (q, s) in layer.items():
                convert(name, q, s, outs[name])
        return run

    def native(name, q, s, out):
        out.copy_(q)
        _scale_tiles(out, s.to(dtype), fmt.block, "mul")

    def float16_layout(name, q, s, out):
        fp8_to_down(q, dtype, out)
        _scale_tiles(out, (s * 256).to(dtype), fmt.block, "mul")

    def placed(name, q, s, out):
        dequantize_weight(q, s, fmt, dtype, out, folded[name])

    def placed_bits_only(name, q, s, out):
        fp8_placed(q, dtype, out)

    def lut_gather(name, q, s, out):
        torch.index_select(lut, 0, q.view(torch.uint8).view(-1).long(), out=out.view(-1))
        _scale_tiles(out, s.to(dtype), fmt.block, "mul")

    xs = {b: {name: torch.randn(b, shape[1], dtype=dtype) for name, shape in shapes.items()} for b in (1, 8)}

    def matmuls(batch: int) -> Callable[[], None]:
        def run() -> None:
            for name, w in outs.items():
                F.linear(xs[batch][name], w)
        return run

    rows: list[dict] = []
    weight_methods = [("torch .to()", each(native)), ("float16 layout", each(float16_layout)),
                      ("LUT gather", each(lut_gather)), ("placed", each(placed)),
                      ("  of which bits only", each(placed_bits_only)),
                      ("matmuls, batch 1", matmuls(1)), ("matmuls, batch 8", matmuls(8))]
    for label, fn in weight_methods:
        rows.append({"what": "one layer's weights", "method": label, "ms": timed(fn, args.repeats)})

    kv_shape = (cfg.num_kv_heads * args.kv_batch, args.kv_context, cfg.head_dim)
    k = (torch.randn(kv_shape) * 4).clamp(-448, 448).to(torch.float8_e4m3fn)
    k_out = torch.empty(kv_shape, dtype=dtype)
    k_scale = 0.02
    kv_methods = [("torch .to()", lambda: k_out.copy_(k).mul_(k_scale)),
                  ("float16 layout", lambda: fp8_to_down(k, dtype, k_out).mul_(k_scale * 256)),
                  ("placed", lambda: fp8_placed(k, dtype, k_out).mul_(k_scale * 2.0**120)),
                  ("placed, scale folded", lambda: fp8_placed(k, dtype, k_out))]  # what decodes do
    for label, fn in kv_methods:
        rows.append({"what": f"one layer's K, {args.kv_batch} x {args.kv_context} tokens", "method": label,
                     "ms": timed(fn, args.repeats)})

    print(f"{args.model}, {args.dtype}, {torch.get_num_threads()} thread(s), load {os.getloadavg()[0]:.1f}")
    base: dict[str, float] = {}
    print(f"{'what':<34}{'method':<24}{'ms':>8}{'x first':>9}")
    for r in rows:
        first = base.setdefault(r["what"], r["ms"])
        r["ratio_to_first"] = r["ms"] / first
        print(f"{r['what']:<34}{r['method']:<24}{r['ms']:>8.3f}{r['ratio_to_first']:>9.2f}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / "fp8_dequant.json"
    path.write_text(json.dumps({"args": vars(args), "loadavg": os.getloadavg(), "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
