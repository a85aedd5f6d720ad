"""Where one forward pass of our model spends its time, at the shapes engine_throughput produces.

Runs chatfleet's Qwen3 model and paged attention directly (no server, no scheduler) on:
  * prefill: one 2,000-token prompt (the cold-TTFT case), and 4 x 500-token chunks (one step of
    the 500-token workload under the 2,048-token budget);
  * decode: one step of 8 and of 32 sequences with ~530 tokens of context each.
For each shape it reports wall time per step, split by torch.profiler into linear layers (GEMMs),
attention, logits, and the rest; then the same with the linear layers run through oneDNN with
prepacked weights (what vLLM's CPU build does) instead of PyTorch's default F.linear (MKL), to
show what that swap is worth here. Prints a table and writes JSON to benchmarks/results/.

  python benchmarks/forward_breakdown.py [--model small] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, load_average  # noqa: E402
from onednn_linear import use_onednn  # noqa: E402

CATEGORIES = {  # profiler op name fragments -> category
    "linear": ("aten::linear", "aten::addmm", "aten::mm", "mkldnn::_linear_pointwise"),
    "attention": ("scaled_dot_product", "aten::bmm", "aten::baddbmm", "aten::softmax", "aten::index_select",
                  "aten::index_copy_"),
}


def make_step(model, cfg, kv_caches, block_size: int, decode_ctx: list[int], chunk_lens: list[int]):
    """(input_ids, positions, metadata) for decodes with the given contexts, then fresh chunks."""
    from chatfleet.engine.models.attention import Workspace, build_attention_metadata

    next_block = 0
    tables: list[list[int]] = []
    for n in decode_ctx + chunk_lens:
        nb = (n + block_size - 1) // block_size
        tables.append(list(range(next_block, next_block + nb)))
        next_block += nb
    meta = build_attention_metadata(
        block_size, decode_ctx, tables[: len(decode_ctx)], [0] * len(chunk_lens), chunk_lens,
        tables[len(decode_ctx):], "cpu",
    )
    meta.workspace = Workspace()
    total = len(decode_ctx) + sum(chunk_lens)
    ids = torch.randint(0, cfg.vocab_size, (total,))
    pos = torch.tensor([c - 1 for c in decode_ctx] + [p for n in chunk_lens for p in range(n)])
    rows = torch.tensor(list(range(len(decode_ctx))) + list(
        len(decode_ctx) + sum(chunk_lens[: i + 1]) - 1 for i in range(len(chunk_lens))))
    return ids, pos, meta, rows, next_block


def time_step(model, ids, pos, meta, rows, kv_caches, reps: int) -> dict:
    def run():
        h = model(ids, pos, meta, kv_caches)
        return model.compute_logits(h[rows])

    with torch.inference_mode():
        run()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
    split: dict[str, float] = defaultdict(float)
    total_self = 0.0
    for ev in prof.key_averages():
        us = ev.self_cpu_time_total
        total_self += us
        cat = next((c for c, keys in CATEGORIES.items() if any(k in ev.key for k in keys)), "other")
        split[cat] += us
    shares = {k: round(v / total_self, 3) for k, v in split.items()} if total_self else {}
    return {"step_ms": round(best * 1000, 2), "share": shares}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from chatfleet.engine.models.attention import KVCache
    from chatfleet.engine.models.loader import load_model
    from chatfleet.models.tiny import resolve_model

    shapes = {
        "prefill 1x2000": ([], [2000]),
        "prefill 4x500": ([], [500, 500, 500, 500]),
        "decode 8x530": ([530] * 8, []),
        "decode 32x530": ([530] * 32, []),
    }
    block = 16
    results: dict[str, dict] = {"load_average_at_start": load_average(), "threads": args.threads,
                                "model": args.model, "torch": torch.__version__, "shapes": {}}
    for backend in ("mkl (F.linear)", "onednn (prepacked)"):
        loaded = load_model(resolve_model(args.model), "float32")
        model, cfg = loaded.model, loaded.config
        if backend.startswith("onednn"):
            use_onednn(model)
        for name, (dec, chunks) in shapes.items():
            blocks_needed = sum((n + block - 1) // block for n in dec + chunks)
            caches = [KVCache.allocate(blocks_needed, block, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
                      for _ in range(cfg.num_layers)]
            ids, pos, meta, rows, _ = make_step(model, cfg, caches, block, dec, chunks)
            r = time_step(model, ids, pos, meta, rows, caches, args.reps)
            tokens = len(dec) + sum(chunks)
            r["tokens_per_s"] = round(tokens / (r["step_ms"] / 1000), 1)
            results["shapes"].setdefault(name, {})[backend] = r
            print(f"{backend:20s} {name:16s} {r['step_ms']:9.2f} ms  {r['tokens_per_s']:9.1f} tok/s  {r['share']}",
                  flush=True)
    out = args.out or RESULTS_DIR / f"forward_breakdown-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
