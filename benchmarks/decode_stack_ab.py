"""Decode steps with the layers in one C++ call (models/decode_stack.py) against the same steps through
the model's modules, paired: one runner, the two alternating step by step over the same sequences,
so a slow minute of a shared machine falls on both.

    python benchmarks/decode_stack_ab.py --dtype bfloat16 --batch 1 8 32
    python benchmarks/decode_stack_ab.py --dtype float32 --threads 1 --steps 80

Per batch: the median step with the stack and with the modules (wall, ms), their ratio and the time
saved. Prints a table and writes JSON (with the machine: CPU model, flags, threads, load) to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.outputs import ScheduledChunk, SchedulerOutput
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.torch_runner import TorchRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR  # noqa: E402
from machine import describe_machine, one_line  # noqa: E402

BLOCK = 16
WARMUP = 6  # steps (3 of each) not counted: the first stack step builds its library and binds the caches


def paired(runner: TorchRunner, batch: int, context: int, steps: int, vocab: int) -> dict:
    """``steps`` decode steps of ``batch`` sequences after their prompts, the stack on every even
    step and off every odd one; the medians of each."""
    model = runner.model
    rng = random.Random(batch)
    per_seq = -(-(context + steps + 1) // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    ids = [f"b{batch}-{i}" for i in range(batch)]
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(context)]
        runner.execute(SchedulerOutput([ScheduledChunk(ids[i], prompt, 0, tables[i], True, params, 0)]))
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for s in range(steps):
            on = s % 2 == 0
            model.decode_stack_enabled = on
            chunks = [ScheduledChunk(ids[i], [rng.randrange(vocab)], context + s, tables[i], True, params, s + 1)
                      for i in range(batch)]
            start = time.perf_counter()
            runner.execute(SchedulerOutput(chunks))
            if s >= WARMUP:
                times[on].append(time.perf_counter() - start)
    finally:
        model.decode_stack_enabled = True
        runner.execute(SchedulerOutput([], finished_request_ids=ids))
    stack, modules = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
    return {"batch": batch, "context": context, "steps_each": len(times[True]), "stack_ms": stack,
            "modules_ms": modules, "ratio": stack / modules, "saved_ms": modules - stack}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16 (the model's and the cache's)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=530)
    ap.add_argument("--steps", type=int, default=60, help="decode steps per batch, half of them each way")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model(args.model), dtype=args.dtype)
    if loaded.model.decode_stack() is None:
        sys.exit("the decode stack does not build here (no AVX-512, no compiler, kernels off, or not oneDNN)")
    blocks = max(args.batch) * (-(-(args.context + args.steps + 1) // BLOCK))
    runner = TorchRunner(loaded, blocks, BLOCK)
    rows = [paired(runner, b, args.context, args.steps, loaded.config.vocab_size) for b in args.batch]
    machine = describe_machine(threads_used=torch.get_num_threads())
    dtype = str(loaded.dtype).removeprefix("torch.")
    table = Table(title=f"decode step, layers in one C++ call vs the modules: {args.model} {dtype}, "
                        f"{torch.get_num_threads()} thread(s), context ~{args.context}, {one_line(machine)}")
    for col in ("batch", "stack ms", "modules ms", "stack / modules", "saved ms"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), f"{r['stack_ms']:.2f}", f"{r['modules_ms']:.2f}", f"{r['ratio']:.3f}",
                      f"{r['saved_ms']:.2f}")
    Console().print(table)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"decode_stack_ab-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"model": args.model, "dtype": dtype, "threads": torch.get_num_threads(),
                                "machine": machine, "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
