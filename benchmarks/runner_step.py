"""TorchRunner alone: prefill tokens/s and decode step time by batch size (no scheduler, no HTTP),
each decode step against the machine's floor, measured here (cpu_floor.py).

    python benchmarks/runner_step.py --model small --batch 1 8 32 --context 500 --threads 2
    python benchmarks/runner_step.py --dtype bfloat16 --kv-cache-dtype fp8 --quantization fp8

The floor: matmul peak for the dtype (a large GEMM's FLOP/s, same threads) and copy bandwidth
(at the step's working-set size); a step's floor is max(bytes read / bandwidth, FLOPs / peak), and
the table shows the measured step as a multiple of it (issue 20's target: within 2x at batch 32).
On a shared host the floor moves between minutes (read bandwidth 22-39 GB/s an hour apart on one
Xeon), so with `--rounds N` the floor is measured again after each round's steps and each round's
step is divided by its own round's floor: the table shows the median of those ratios and their
range, and the JSON keeps every round's floor.
Prints a table and writes JSON (with the machine: CPU model, flags, threads, load) to
benchmarks/results/. CPU time (process) is printed next to wall time: on a shared machine it
shows the runner's own cost. `--no-floor` skips the floor measurement. The objects alive once the
runners are built are frozen out of the garbage collector's passes, as the engine's process freezes
its own at start-up (``protocol/startup_gc.py``).
"""

from __future__ import annotations

import argparse
import json
import os
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
from chatfleet.protocol.startup_gc import freeze_startup_objects

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_floor import Floor, StepWork, against_floor, decode_work, measure_floor  # noqa: E402
from machine import describe_machine, one_line  # noqa: E402

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


def _against(got: dict, work: StepWork, floor: Floor) -> dict:
    """One round's step against that round's floor (its CPU time too where one thread ran it)."""
    cpu_s = got["decode_step_ms_cpu"] / 1e3 if floor.threads == 1 else None
    return against_floor(got["decode_step_ms_wall"] / 1e3, work, floor, cpu_s)


def _median_index(values: list[float]) -> int:
    """The index of the median value (the lower middle one for an even count)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(order) - 1) // 2]


def _spread(f: dict) -> str:
    low, high = f.get("step_over_floor_low"), f.get("step_over_floor_high")
    return "" if low is None or high is None or low == high else f" ({low:.1f}-{high:.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtype", default="float32",
                    help="the model's (and activations') dtype; auto: bfloat16 where the CPU has it natively")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), bfloat16, float32, fp8")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="quantize the linears at load")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--no-floor", action="store_true", help="skip measuring the machine's floor")
    ap.add_argument("--decode-kernel", default="auto",
                    help="CPU decode attention: cpp (the C++ kernel), torch (torch ops), auto (cpp where it "
                         "builds); a comma list (torch,cpp) measures each on its own runner, interleaved")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every (decode kernel, batch) this many times, the kernels' order flipped "
                         "each round, and the floor again after each round; the table shows the medians")
    args = ap.parse_args()
    kernels = args.decode_kernel.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model(args.model), dtype=args.dtype, quantization=args.quantization)
    blocks = max(args.batch) * (-(-(args.context + args.steps + 1) // BLOCK))
    runners = [TorchRunner(loaded, blocks, BLOCK, kv_cache_dtype=args.kv_cache_dtype, decode_kernel=k)
               for k in kernels]
    runner = runners[0]
    freeze_startup_objects()  # as the engine's process does once it is up: GC passes walk only what steps make
    params = SamplingParams(max_tokens=args.steps + 1, temperature=args.temperature, top_p=args.top_p,
                            ignore_eos=True)
    works: dict[int, StepWork] = {}
    if not args.no_floor:
        kv_per_token = sum(2 * c.key.shape[0] * c.key.shape[3] * c.key.element_size()
                           for c in runner.kv_caches if c is not None)
        weight_bytes = 1.0 if args.quantization == "fp8" else torch.empty((), dtype=loaded.dtype).element_size()
        mid = args.context + args.steps // 2  # the context at the median step
        works = {b: decode_work(loaded.config, b, mid, weight_bytes, kv_per_token) for b in args.batch}
    rounds: dict[tuple[int, int], list[dict]] = {}
    floors: list[Floor] = []  # one per round, measured right after that round's steps
    for r in range(args.rounds):
        for b in args.batch:
            order = range(len(runners)) if r % 2 == 0 else reversed(range(len(runners)))
            for i in order:
                rounds.setdefault((i, b), []).append(
                    measure(runners[i], b, args.context, args.steps, params, loaded.config.vocab_size))
        if works:
            floors.append(measure_floor(loaded.dtype, max(w.bytes_read for w in works.values())))
    rows = []
    for (i, b), got in sorted(rounds.items()):
        row = {key: statistics.median(g[key] for g in got) for key in got[0] if key not in ("batch", "context")}
        rows.append({"batch": b, "context": args.context, "decode_kernel": runners[i].decode_kernel, **row,
                     "rounds": got})
        if floors:
            per_round = [_against(g, works[b], f) for g, f in zip(got, floors, strict=True)]
            for g, verdict in zip(got, per_round, strict=True):
                g["floor"] = verdict
            ratios = sorted(v["step_over_floor"] for v in per_round)
            rows[-1]["floor"] = {**per_round[_median_index([v["step_over_floor"] for v in per_round])],
                                 "step_over_floor_low": ratios[0], "step_over_floor_high": ratios[-1]}
    floor = floors[_median_index([f.bandwidth for f in floors])] if floors else None

    dtype = str(loaded.dtype).removeprefix("torch.")  # --dtype auto resolved
    precision = f"{dtype}, KV {args.kv_cache_dtype}, {args.rounds} round(s)"
    if args.quantization:
        precision += f", {args.quantization} weights"
    machine = describe_machine(threads_used=torch.get_num_threads())
    table = Table(title=f"TorchRunner, {args.model} {precision}, {torch.get_num_threads()} threads, "
                        f"{one_line(machine)}")
    cols = ["decode", "batch", "prefill tok/s", "decode step ms (wall / cpu)", "decode tok/s"]
    if floor is not None:
        cols += ["floor ms (bytes / flops)", "bound", "step / floor (wall / cpu)"]
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        cells = [r["decode_kernel"], str(r["batch"]), f"{r['prefill_tok_s_wall']:.0f}",
                 f"{r['decode_step_ms_wall']:.1f} / {r['decode_step_ms_cpu']:.1f}", f"{r['decode_tok_s_wall']:.0f}"]
        if floor is not None:
            f = r["floor"]
            cells += [f"{f['floor_ms']:.2f} ({f['bytes_bound_ms']:.2f} / {f['flops_bound_ms']:.2f})",
                      f["bound_by"], f"{f['step_over_floor']:.1f}x{_spread(f)} / "
                      + ("-" if f["cpu_step_over_floor"] is None else f"{f['cpu_step_over_floor']:.1f}x")]
        table.add_row(*cells)
    Console(width=160).print(table)
    if len(floors) > 1:
        print("floor per round: " + ", ".join(
            f"read {f.read_bytes_per_s / 1e9:.1f} GB/s, {f.matmul_flops_per_s / 1e9:.0f} GFLOP/s" for f in floors)
            + "; each round's step is divided by its own round's floor (the table: the median ratio, its range)")
    if floor is not None:
        print(f"floor ({floor.dtype}, {floor.threads} threads): matmul {floor.matmul_flops_per_s / 1e9:.1f} GFLOP/s "
              f"(GEMM {floor.gemm_size}^3); at {floor.copy_working_set_bytes / 2**20:.0f} MiB copy "
              f"{floor.copy_bytes_per_s / 1e9:.1f} GB/s, read {floor.read_bytes_per_s / 1e9:.1f} GB/s; "
              f"copy at 1 GiB {floor.dram_copy_bytes_per_s / 1e9:.1f} GB/s")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"runner_step-{time.strftime('%Y%m%d-%H%M%S')}.json"
    machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    path.write_text(json.dumps({"args": vars(args), "dtype": dtype,
                                "decode_kernels": [r.decode_kernel for r in runners],
                                "threads": torch.get_num_threads(),
                                "machine": machine,
                                "loadavg": os.getloadavg(), "floor": floor.as_dict() if floor else None,
                                "floors_per_round": [f.as_dict() for f in floors],
                                "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
