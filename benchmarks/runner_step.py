"""TorchRunner alone: prefill tokens/s and decode step time by batch size (no scheduler, no HTTP).

    python benchmarks/runner_step.py --model small --batch 1 8 32 --context 500 --threads 2
    python benchmarks/runner_step.py --dtype bfloat16 --kv-cache-dtype fp8 --quantization fp8

Prints a table and writes JSON to benchmarks/results/. CPU time (process) is printed next to
wall time: on a shared machine it shows the runner's own cost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from chatfleet.engine.models.loader import load_model
from chatfleet.engine.outputs import ScheduledChunk, SchedulerOutput
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.torch_runner import TorchRunner
from chatfleet.models.tiny import resolve_model

BLOCK = 16


def measure(runner: TorchRunner, batch: int, context: int, steps: int, params: SamplingParams,
            vocab: int) -> dict:
    rng = random.Random(batch)
    blocks_per_seq = -(-(context + steps + 1) // BLOCK)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    ids = [f"b{batch}-{i}" for i in range(batch)]
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(batch):  # one prompt per step, like a 2048-token budget would for ~500-token prompts
        runner.execute(SchedulerOutput([ScheduledChunk(ids[i], prompts[i], 0, tables[i], True, params, 0)]))
    prefill_wall, prefill_cpu = time.perf_counter() - wall, time.process_time() - cpu
    step_wall, step_cpu = [], []
    for s in range(steps):
        chunks = [ScheduledChunk(ids[i], [rng.randrange(vocab)], context + s, tables[i], True, params, s + 1)
                  for i in range(batch)]
        wall, cpu = time.perf_counter(), time.process_time()
        runner.execute(SchedulerOutput(chunks))
        step_wall.append(time.perf_counter() - wall)
        step_cpu.append(time.process_time() - cpu)
    runner.execute(SchedulerOutput([], finished_request_ids=ids))
    med_wall, med_cpu = statistics.median(step_wall), statistics.median(step_cpu)
    return {
        "batch": batch,
        "context": context,
        "prefill_tok_s_wall": batch * context / prefill_wall,
        "prefill_tok_s_cpu": batch * context / prefill_cpu,
        "decode_step_ms_wall": med_wall * 1e3,
        "decode_step_ms_cpu": med_cpu * 1e3,
        "decode_tok_s_wall": batch / med_wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtype", default="float32", help="the model's (and activations') dtype")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), bfloat16, float32, fp8")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="quantize the linears at load")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model(args.model), dtype=args.dtype, quantization=args.quantization)
    blocks = max(args.batch) * (-(-(args.context + args.steps + 1) // BLOCK))
    runner = TorchRunner(loaded, blocks, BLOCK, kv_cache_dtype=args.kv_cache_dtype)
    params = SamplingParams(max_tokens=args.steps + 1, temperature=args.temperature, top_p=args.top_p,
                            ignore_eos=True)
    rows = [measure(runner, b, args.context, args.steps, params, loaded.config.vocab_size) for b in args.batch]

    precision = f"{args.dtype}, KV {args.kv_cache_dtype}" + (f", {args.quantization} weights" if args.quantization else "")
    table = Table(title=f"TorchRunner, {args.model} {precision}, {torch.get_num_threads()} threads, "
                        f"load {os.getloadavg()[0]:.1f}")
    for col in ("batch", "prefill tok/s", "decode step ms (wall / cpu)", "decode tok/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), f"{r['prefill_tok_s_wall']:.0f}",
                      f"{r['decode_step_ms_wall']:.1f} / {r['decode_step_ms_cpu']:.1f}",
                      f"{r['decode_tok_s_wall']:.0f}")
    Console().print(table)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"runner_step-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"args": vars(args), "threads": torch.get_num_threads(),
                                "loadavg": os.getloadavg(), "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
