"""Decode steps with one thing switched on against the same steps with it off, paired: one runner, the
two alternating step by step over the same sequences, so a slow minute of a shared machine falls on
both. ``--switch stack`` (the default): the layers in one C++ call (models/decode_stack.py) against
the model's modules; with ``--chunk N`` every step also carries N new prompt tokens of one more
sequence whose history is cached (a returning turn: the step capacity.py's ``all`` runs at its knee).
``--switch amx``: the packed decode linears' bf16 sums on AMX tiles against
AVX-512 (models/packed_gemv.py; an AMX CPU, bf16 only; the stack on for both). ``--switch
attention``: bf16 paged decode attention on AMX tiles against AVX-512 (models/paged_decode_amx.h).
``--switch prefetch``: the AVX-512 decode attention (float32; FP8 caches; bf16 without AMX) with its
software prefetch of blocks that continue a run in memory against leaving those to the hardware
prefetcher (paged_decode_cpu.prefetch_runs; on by default on Intel, off on AMD). The sequences'
blocks lie in order here, as a prompt's blocks do.

    python benchmarks/decode_stack_ab.py --dtype bfloat16 --batch 1 8 32
    python benchmarks/decode_stack_ab.py --dtype float32 --threads 1 --steps 80
    python benchmarks/decode_stack_ab.py --dtype bfloat16 --switch amx
    python benchmarks/decode_stack_ab.py --dtype bfloat16 --switch attention --context 2000
    python benchmarks/decode_stack_ab.py --dtype float32 --switch prefetch --batch 8 32 --threads 1
    python benchmarks/decode_stack_ab.py --dtype bfloat16 --batch 8 16 --chunk 40   # returning turns

Per batch: the median step with it on and off (wall, ms), their ratio and the time saved. Prints a
table and writes JSON (with the machine: CPU model, flags, threads, load) to benchmarks/results/.
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
from chatfleet.engine.models import packed_gemv, paged_decode_cpu
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.outputs import ScheduledChunk, SchedulerOutput
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.torch_runner import TorchRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR  # noqa: E402
from machine import describe_machine, one_line  # noqa: E402

BLOCK = 16
WARMUP = 6  # steps (3 of each) not counted: the first stack step builds its library and binds the caches


def _switch(runner: TorchRunner, what: str, on: bool) -> None:
    if what == "stack":
        runner.model.decode_stack_enabled = on
    elif what == "prefetch":
        paged_decode_cpu.prefetch_runs(on)
    elif (paged_decode_cpu.use_amx(on) if what == "attention" else packed_gemv.use_amx(on)) != on:
        sys.exit("AMX does not run here: no AMX on this CPU, or the OS refused its tile state")


def paired(runner: TorchRunner, batch: int, context: int, steps: int, vocab: int, what: str, chunk: int = 0) -> dict:
    """``steps`` decode steps of ``batch`` sequences after their prompts (with ``chunk``, each step
    also carries ``chunk`` new prompt tokens of one more sequence, its history cached: a returning
    turn), ``what`` on every even step and off every odd one; the medians of each."""
    rng = random.Random(batch)
    per_seq = -(-(context + steps * max(chunk, 1) + 1) // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch + 1)]
    ids = [f"b{batch}-{i}" for i in range(batch)] + ([f"b{batch}-turn"] if chunk else [])
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(len(ids)):
        prompt = [rng.randrange(vocab) for _ in range(context)]
        runner.execute(SchedulerOutput([ScheduledChunk(ids[i], prompt, 0, tables[i], True, params, 0)]))
    times: dict[bool, list[float]] = {True: [], False: []}
    default = paged_decode_cpu.prefetch_runs() if what == "prefetch" else True  # restored after
    try:
        for s in range(steps):
            on = s % 2 == 0
            _switch(runner, what, on)
            chunks = [ScheduledChunk(ids[i], [rng.randrange(vocab)], context + s, tables[i], True, params, s + 1)
                      for i in range(batch)]
            if chunk:
                chunks.append(ScheduledChunk(ids[batch], [rng.randrange(vocab) for _ in range(chunk)],
                                             context + s * chunk, tables[batch], True, params, 0))
            start = time.perf_counter()
            runner.execute(SchedulerOutput(chunks))
            if s >= WARMUP:
                times[on].append(time.perf_counter() - start)
    finally:
        _switch(runner, what, default)
        runner.execute(SchedulerOutput([], finished_request_ids=ids))
    on_ms, off_ms = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
    return {"batch": batch, "context": context, "chunk": chunk, "steps_each": len(times[True]), "switch": what,
            "on_ms": on_ms,
            "off_ms": off_ms, "ratio": on_ms / off_ms, "saved_ms": off_ms - on_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16 (the model's and the cache's)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=530)
    ap.add_argument("--steps", type=int, default=60, help="decode steps per batch, half of them each way")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--switch", choices=("stack", "amx", "attention", "prefetch"), default="stack",
                    help="stack: one C++ call vs the modules; amx: bf16 linears on AMX tiles vs AVX-512; "
                         "attention: bf16 decode attention on AMX tiles vs AVX-512; prefetch: the AVX-512 "
                         "decode attention's software prefetch of blocks that continue a run in memory vs "
                         "leaving those to the hardware prefetcher")
    ap.add_argument("--chunk", type=int, default=0,
                    help="each step also carries this many new prompt tokens of one more sequence whose history "
                         "is cached (a returning turn beside the decodes)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model(args.model), dtype=args.dtype)
    if loaded.model.decode_stack() is None:
        sys.exit("the decode stack does not build here (no AVX-512, no compiler, kernels off, or not oneDNN)")
    blocks = (max(args.batch) + 1) * (-(-(args.context + args.steps * max(args.chunk, 1) + 1) // BLOCK))
    runner = TorchRunner(loaded, blocks, BLOCK)
    rows = [paired(runner, b, args.context, args.steps, loaded.config.vocab_size, args.switch, args.chunk)
            for b in args.batch]
    machine = describe_machine(threads_used=torch.get_num_threads())
    dtype = str(loaded.dtype).removeprefix("torch.")
    on, off = {"stack": ("stack", "modules"), "prefetch": ("runs prefetched", "runs left")}.get(
        args.switch, ("AMX", "AVX-512"))
    what = {"stack": "layers in one C++ call vs the modules", "amx": "bf16 linears on AMX vs AVX-512",
            "attention": "bf16 decode attention on AMX vs AVX-512",
            "prefetch": "decode attention's blocks in runs prefetched vs left to the hardware"}[args.switch]
    turn = f", + a {args.chunk}-token prompt chunk a step" if args.chunk else ""
    table = Table(title=f"decode step{turn}, {what}: {args.model} {dtype}, {torch.get_num_threads()} thread(s), "
                        f"context ~{args.context}, {one_line(machine)}")
    for col in ("batch", f"{on} ms", f"{off} ms", f"{on} / {off}", "saved ms"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), f"{r['on_ms']:.2f}", f"{r['off_ms']:.2f}", f"{r['ratio']:.3f}",
                      f"{r['saved_ms']:.2f}")
    Console().print(table)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"decode_stack_ab-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"model": args.model, "dtype": dtype, "threads": torch.get_num_threads(),
                                "machine": machine, "switch": args.switch, "chunk": args.chunk,
                                "prefetch_runs_default": paged_decode_cpu.prefetch_runs(), "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
