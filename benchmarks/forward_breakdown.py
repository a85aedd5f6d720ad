"""Where one forward step of our model spends its time, at the shapes engine_throughput produces.

Runs chatfleet's Qwen3 model with its paged attention directly (no server, no scheduler) on:
  * prefill: one 2,000-token prompt (the cold-TTFT case), and 4 x 500-token chunks (one step of
    the 500-token workload under the 2,048-token budget);
  * decode: one step of 8 and of 32 sequences with ~530 tokens of context each.
For each shape and each kernel backend (`--kernels torch` and `onednn`) it reports the best wall
time per step and its split, timed by module hooks: linear layers (GEMMs), attention (its
module minus its linears: q/k norm, RoPE, cache writes, the attention products), MLP activation,
logits, and the rest (embedding, layer norms, residuals). Prints a table and writes JSON to
benchmarks/results/.

  python benchmarks/forward_breakdown.py [--model small] [--threads 1] [--kernels torch,onednn]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, load_average  # noqa: E402

SHAPES = {  # name -> (decode context lengths, fresh prefill chunk lengths)
    "prefill 1x2000": ([], [2000]),
    "prefill 4x500": ([], [500, 500, 500, 500]),
    "decode 8x530": ([530] * 8, []),
    "decode 32x530": ([530] * 32, []),
}
BLOCK = 16


class HookTimer:
    """Inclusive wall time per module group, from forward pre/post hooks (one thread, eager)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._starts: dict[int, float] = {}
        for name, mod in model.named_modules():
            kind = type(mod).__name__
            if kind == "Linear":
                key = "linear_head" if "lm_head" in name else "linear_attn" if "self_attn" in name else "linear_mlp"
            elif kind in ("Qwen3Attention", "Qwen3MLP"):
                key = kind
            else:
                continue
            mod.register_forward_pre_hook(self._pre)
            mod.register_forward_hook(lambda m, i, o, key=key: self._post(m, key))

    def _pre(self, module, args) -> None:  # noqa: ANN001
        self._starts[id(module)] = time.perf_counter()

    def _post(self, module, key: str) -> None:  # noqa: ANN001
        self.totals[key] += time.perf_counter() - self._starts.pop(id(module))


def make_step(cfg, decode_ctx: list[int], chunk_lens: list[int]):  # noqa: ANN001, ANN201
    """(input_ids, positions, metadata, logits rows, blocks used) for one step."""
    from chatfleet.engine.models.attention import build_attention_metadata
    from chatfleet.engine.models.workspace import Workspace

    next_block = 0
    tables: list[list[int]] = []
    for n in decode_ctx + chunk_lens:
        nb = (n + BLOCK - 1) // BLOCK
        tables.append(list(range(next_block, next_block + nb)))
        next_block += nb
    meta = build_attention_metadata(BLOCK, decode_ctx, tables[: len(decode_ctx)], [0] * len(chunk_lens),
                                    chunk_lens, tables[len(decode_ctx):], "cpu")
    meta.workspace = Workspace()
    ids = torch.randint(0, cfg.vocab_size, (len(decode_ctx) + sum(chunk_lens),))
    pos = torch.tensor([c - 1 for c in decode_ctx] + [p for n in chunk_lens for p in range(n)])
    ends = [len(decode_ctx) + sum(chunk_lens[: i + 1]) - 1 for i in range(len(chunk_lens))]
    rows = torch.tensor(list(range(len(decode_ctx))) + ends)
    return ids, pos, meta, rows, next_block


def time_shape(model, cfg, decode_ctx: list[int], chunk_lens: list[int], reps: int) -> dict:  # noqa: ANN001
    from chatfleet.engine.models.attention import KVCache

    ids, pos, meta, rows, blocks = make_step(cfg, decode_ctx, chunk_lens)
    caches = [KVCache.allocate(blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
              for _ in range(cfg.num_layers)]
    timer = HookTimer(model)
    best, split = float("inf"), {}
    with torch.inference_mode():
        for i in range(reps + 1):
            timer.totals.clear()
            t0 = time.perf_counter()
            h = model(ids, pos, meta, caches)
            t1 = time.perf_counter()
            model.compute_logits(h[rows])
            t2 = time.perf_counter()
            if i and t2 - t0 < best:  # the first run warms up
                best, tt = t2 - t0, dict(timer.totals)
                attn, mlp = tt.get("Qwen3Attention", 0.0), tt.get("Qwen3MLP", 0.0)
                split = {
                    "linear": tt.get("linear_attn", 0.0) + tt.get("linear_mlp", 0.0),
                    "attention": attn - tt.get("linear_attn", 0.0),
                    "mlp_act": mlp - tt.get("linear_mlp", 0.0),
                    "logits": t2 - t1,
                    "rest": (t1 - t0) - attn - mlp,
                }
    tokens = len(decode_ctx) + sum(chunk_lens)
    return {
        "step_ms": round(best * 1000, 2),
        "tokens_per_s": round(tokens / best, 1),
        "ms": {k: round(v * 1000, 2) for k, v in split.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--kernels", default="torch,onednn", help="comma list of kernel backends")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from chatfleet.engine.builtin_models.tiny import resolve_model
    from chatfleet.engine.models.loader import load_model

    result: dict = {"load_average_at_start": load_average(), "threads": args.threads, "model": args.model,
                    "torch": torch.__version__, "shapes": {}}
    table = Table(title=f"forward step of {args.model}, {args.threads} thread(s): ms per step")
    for col in ("shape", "kernels", "step", "tok/s", "linear", "attention", "mlp act", "logits", "rest"):
        table.add_column(col, justify="left" if col in ("shape", "kernels") else "right")
    for kernels in args.kernels.split(","):
        loaded = load_model(resolve_model(args.model), "float32", kernels=kernels)
        for name, (dec, chunks) in SHAPES.items():
            r = time_shape(loaded.model, loaded.config, dec, chunks, args.reps)
            result["shapes"].setdefault(name, {})[kernels] = r
            ms = r["ms"]
            table.add_row(name, kernels, f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:.0f}",
                          *(f"{ms[k]:.1f}" for k in ("linear", "attention", "mlp_act", "logits", "rest")))
    Console(width=140).print(table)
    out = args.out or RESULTS_DIR / f"forward_breakdown-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
