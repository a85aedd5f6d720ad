"""Where an engine step's time goes on this CPU, per dtype, for a decode-heavy and a prefill-heavy run
(issue 20, point 1).

Two views, both re-runnable on any machine:
  * in process (torch.profiler): the real Engine (scheduler, KV manager, runner, sampler, output
    processor) steps through the workload with named ranges around its phases and every model
    module; each top-level op is charged to the innermost range and to a kind (GEMM, KV gather,
    KV write, attention products), and a range's own time, between ops, is Python dispatch; the
    C++ kernels (ctypes calls) are ranges of their own, charged to the row of the work they do.
    Shares are scaled onto the unprofiled step time measured on a twin pass.
  * over HTTP (py-spy): `chatfleet engine` serving the same workload through the OpenAI API;
    each sample is charged to the innermost frame that names a part (model, sampler, runner,
    scheduler, detokenizer/output, HTTP path and event loop).

Workloads: decode = 32 streams, ~32-token prompts, 64 output tokens (steps after every prompt is
in); prefill = 4 x ~2,000-token prompts, 4 output tokens; returning (in process only) = 48
conversations whose ~500-token first turns (unmeasured) come back with their 16-token replies and
40 new tokens, one joining per step, 16 output tokens: the prefix-cache-hit turns capacity.py's
`all` runs at its knee, where most steps carry one turn's prompt chunk beside ~15 decode rows;
streams32 = engine_throughput.py's 32-stream point: 96 ~500-token prompts, 64 output tokens, 32 at a
time in a closed loop (each finished request lets the next in), every step measured.
Prints tables and writes JSON (with the machine) to benchmarks/results/.

  python benchmarks/profile_step.py                                   # float32 + bf16 (where native)
  python benchmarks/profile_step.py --dtypes float32 --skip-http --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backends import BACKENDS  # noqa: E402
from common import RESULTS_DIR, PromptFactory, ServerProcess, free_port, load_average  # noqa: E402
from engine_throughput import closed_loop  # noqa: E402
from machine import default_dtypes, describe_machine, one_line  # noqa: E402

RANGE = "cf:"  # prefix of the profiler ranges this script adds
PY_SPY = Path(sys.executable).with_name("py-spy")


@dataclass(frozen=True)
class Workload:
    name: str
    streams: int
    prompt_tokens: int
    output_tokens: int
    profile_steps: int | None  # decode-only steps to profile (None: every step of the run)
    new_tokens: int = 0  # > 0: a returning turn (history + reply + this many new tokens) is measured
    arrivals_per_step: int = 0  # > 0: the measured requests join this many a step (0: all at once)
    requests: int = 0  # > streams: a closed loop (streams at once, the next joins as one finishes)


WORKLOADS = {
    "decode": Workload("decode", 32, 32, 64, profile_steps=16),
    "prefill": Workload("prefill", 4, 2000, 4, profile_steps=None),
    # capacity.py's `all` at its knee: histories come back from the prefix cache, each turn prefills
    # only its new tokens (~40) and decodes a short reply, and turns keep arriving, so a step is one
    # turn's prompt chunk beside ~15 running replies' decode rows
    "returning": Workload("returning", 48, 500, 16, profile_steps=None, new_tokens=40, arrivals_per_step=1),
    # engine_throughput.py's 32-stream point: 96 distinct ~500-token prompts, 64 output tokens, 32 at
    # a time (a closed loop, in waves: prompt steps of ~2,000 tokens, then decode steps at batch ~32)
    "streams32": Workload("streams32", 32, 500, 64, profile_steps=None, requests=96),
}

# ---- in-process view ----------------------------------------------------------------------------

# (innermost range kind, op name) -> category. Range kinds are module class names or phase names.
GEMM_OPS = {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "mkldnn::_linear_pointwise"}
GATHER_OPS = {"aten::index_select", "aten::gather", "aten::index", "aten::take"}
KV_WRITE_OPS = {"aten::index_copy_", "aten::index_put_", "aten::_index_put_impl_"}
ATTENTION_PRODUCT_OPS = {"aten::bmm", "aten::baddbmm", "aten::softmax", "aten::_softmax", "aten::embedding_bag",
                         "aten::_embedding_bag", "aten::_embedding_bag_forward_only",
                         "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                         "mkldnn::_matmul_nt"}
PHASES = {  # range kind -> the row its own time and its ops go to
    "schedule": "scheduler (schedule + update)",
    "update": "scheduler (schedule + update)",
    "metadata": "attention metadata (per step)",
    "execute": "runner (inputs, tensors, rows)",
    "logits": "logits (LM head GEMM, float32 cast)",
    "sample": "sampling",
    "process": "output processing (detokenize, stops)",
    "step": "engine step (other)",
}
# The model's C++ kernels (ctypes calls: no torch op inside) as ranges of their own, charged to the
# row of the work they do; without them a kernel's time would read as Python dispatch.
KERNEL_ROWS = {
    "kernel:qk_norm_rope": "attention: RoPE, reshapes",
    "kernel:chunk_attention": "attention: products",
    "kernel:decode_attention": "attention: products",
    "kernel:decode_stack": "decode stack (C++: every layer of a step of <= 128 rows)",
    "kernel:rms_norm": "norms (RMSNorm)",
    "kernel:silu_and_mul": "MLP activation",
}
DISPATCH = "Python dispatch (model modules)"
UNATTRIBUTED = "unattributed (rest of the step)"
ROWS = [
    "scheduler (schedule + update)", "attention metadata (per step)", "runner (inputs, tensors, rows)",
    DISPATCH, "decode stack (C++: every layer of a step of <= 128 rows)", "linears (GEMM)", "attention: KV gather",
    "attention: products",
    "attention: KV writes", "attention: RoPE, reshapes", "norms (RMSNorm)", "MLP activation",
    "residuals, embedding, other ops", "logits (LM head GEMM, float32 cast)", "sampling",
    "output processing (detokenize, stops)", "engine step (other)",
]
REPORT_ROWS = [*ROWS, UNATTRIBUTED]


def _op_row(kind: str, op: str) -> str:
    if kind in PHASES:
        return PHASES[kind]
    if kind in KERNEL_ROWS:
        return KERNEL_ROWS[kind]
    if kind == "Linear" or op in GEMM_OPS and kind != "Qwen3Attention":
        return "linears (GEMM)"
    if "Norm" in kind:
        return "norms (RMSNorm)"
    if kind.endswith("Attention"):
        if op in GATHER_OPS:
            return "attention: KV gather"
        if op in KV_WRITE_OPS:
            return "attention: KV writes"
        if op in ATTENTION_PRODUCT_OPS or op in GEMM_OPS:
            return "attention: products"
        return "attention: RoPE, reshapes"
    if kind.endswith("MLP"):
        return "MLP activation"
    return "residuals, embedding, other ops"


class Ranges:
    """Named profiler ranges around engine phases (wrapped instance methods) and model modules."""

    def __init__(self) -> None:
        self._open: list[torch.autograd.profiler.record_function] = []

    def wrap(self, obj: object, attr: str, kind: str) -> None:
        inner: Callable = getattr(obj, attr)

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - passes through
            with torch.autograd.profiler.record_function(RANGE + kind):
                return inner(*args, **kwargs)

        timed._profile_range = True  # type: ignore[attr-defined]
        setattr(obj, attr, timed)

    def wrap_kernels(self) -> None:
        """A range around each C++ kernel entry point, where the model's modules call it."""
        from chatfleet.engine.models import attention, decode_stack, prefill_attention, qwen3, swiglu

        for obj, attr, kind in ((qwen3, "qk_norm_rope", "kernel:qk_norm_rope"),
                                (qwen3, "rms_norm", "kernel:rms_norm"),
                                (qwen3, "add_rms_norm", "kernel:rms_norm"),
                                (swiglu, "silu_and_mul", "kernel:silu_and_mul"),  # where swiglu calls it
                                (prefill_attention.amx, "chunk_attention_amx", "kernel:chunk_attention"),
                                (prefill_attention.avx512, "chunk_attention_avx512", "kernel:chunk_attention"),
                                (attention, "paged_decode", "kernel:decode_attention"),
                                (decode_stack.DecodeStack, "run", "kernel:decode_stack")):
            if not getattr(getattr(obj, attr), "_profile_range", False):  # once per process
                self.wrap(obj, attr, kind)

    def hook_modules(self, model: torch.nn.Module) -> None:
        for mod in model.modules():
            mod.register_forward_pre_hook(self._enter)
            mod.register_forward_hook(self._exit)

    def _enter(self, module: torch.nn.Module, args: object) -> None:
        rf = torch.autograd.profiler.record_function(RANGE + type(module).__name__)
        rf.__enter__()
        self._open.append(rf)

    def _exit(self, module: torch.nn.Module, args: object, out: object) -> None:
        self._open.pop().__exit__(None, None, None)


def _under(ev, name: str) -> bool:  # noqa: ANN001 - a FunctionEvent
    """True where a range called `name` encloses the event (the LM head's GEMM: logits, not linears)."""
    p = ev.cpu_parent
    while p is not None:
        if p.name == name:
            return True
        p = p.cpu_parent
    return False


def _descendants(ev) -> int:  # noqa: ANN001 - a FunctionEvent
    return sum(1 + _descendants(c) for c in ev.cpu_children)


def attribute(events, top_ops: dict[str, dict[str, float]] | None = None  # noqa: ANN001 - EventList
              ) -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
    """Microseconds per row (ranges' own time, Python between ops; top-level ops' total time),
    and the recorded ranges and ops inside each row (the profiler's cost grows with both)."""
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    range_counts: dict[str, int] = defaultdict(int)
    for ev in events:
        if ev.name.startswith(RANGE):
            kind = ev.name[len(RANGE):]
            row = PHASES.get(kind) or KERNEL_ROWS.get(kind, DISPATCH)
            totals[row] += ev.self_cpu_time_total
            range_counts[row] += 1
            continue
        parent = ev.cpu_parent
        if parent is not None and not parent.name.startswith(RANGE):
            continue  # inside another op: counted in that op's total
        kind = parent.name[len(RANGE):] if parent is not None else "step"
        row = PHASES["logits"] if _under(ev, RANGE + "logits") else _op_row(kind, ev.name)
        totals[row] += ev.cpu_time_total
        counts[row] += 1 + _descendants(ev)
        if top_ops is not None:
            top_ops.setdefault(row, {})
            top_ops[row][ev.name] = top_ops[row].get(ev.name, 0.0) + ev.cpu_time_total
    return dict(totals), dict(counts), dict(range_counts)


class _Noop(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _loop_seconds(fn: Callable[[], object], n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t0


def profiler_costs(n: int = 3000) -> tuple[float, float]:
    """What the profiler adds per recorded op, and what a hooked module range adds, in ms
    (best of 3: a trivial op and an empty module, each with the profiler on and off)."""
    x = torch.ones(4)
    plain_mod, hooked = _Noop(), _Noop()
    Ranges().hook_modules(hooked)
    op_cost, range_cost = [], []
    with torch.inference_mode():
        for _ in range(3):
            op_off = _loop_seconds(lambda: x.add_(0), n)
            mod_off = _loop_seconds(lambda: plain_mod(x), n)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
                op_on = _loop_seconds(lambda: x.add_(0), n)
                mod_on = _loop_seconds(lambda: hooked(x), n)
            op_cost.append((op_on - op_off) / n)
            range_cost.append((mod_on - mod_off) / n)
    return max(0.0, min(op_cost)) * 1e3, max(0.0, min(range_cost)) * 1e3


def build_engine(model: str, dtype: str, threads: int, kv_bytes: int = 256 << 20):  # noqa: ANN201 - chatfleet's Engine
    """The in-process Engine the benchmarks step (4,096-token context, ``kv_bytes`` of KV)."""
    from chatfleet.engine.config import CacheConfig, EngineConfig
    from chatfleet.engine.engine import Engine

    return Engine(EngineConfig(model=model, dtype=dtype, num_threads=threads, max_model_len=4096,
                               cache=CacheConfig(memory_bytes=kv_bytes)))


def _requests(engine, w: Workload, tag: str, seed: int) -> list[tuple[str, list[int], object]]:  # noqa: ANN001
    """The measured requests (id, prompt ids, sampling params); a returning workload's first turns
    run here, unmeasured."""
    from chatfleet.engine.request import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=w.output_tokens, min_tokens=w.output_tokens, ignore_eos=True,
                            temperature=0.0)
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(w.prompt_tokens)]  # distinct: nothing
               for _ in range(max(w.streams, w.requests))]                          # shared by the cache
    if w.new_tokens:  # the first turns, unmeasured; their histories come back with new tokens
        for i, ids in enumerate(prompts):
            engine.add_request(f"{tag}-first-{i}", ids, params)
        replies: dict[str, list[int]] = defaultdict(list)
        while engine.has_unfinished_requests():
            for out in engine.step():
                replies[out.request_id].extend(out.new_token_ids)
        prompts = [ids + replies[f"{tag}-first-{i}"] + [rng.randrange(3, engine.vocab_size)
                                                         for _ in range(w.new_tokens)]
                   for i, ids in enumerate(prompts)]
    return [(f"{tag}-{i}", ids, params) for i, ids in enumerate(prompts)]


def _decoding(engine) -> bool:  # noqa: ANN001
    return not engine.scheduler.num_waiting and all(
        r.num_output_tokens > 0 for r in engine.scheduler.running)


def run_pass(engine, w: Workload, tag: str, seed: int, prof=None) -> dict:  # noqa: ANN001
    """Step the workload through; time (and, with `prof`, profile) the window it measures."""
    pending = _requests(engine, w, tag, seed)
    window: list[float] = []
    cpu: list[float] = []
    finished, first = 0, True  # a closed loop lets one join per finished request
    while pending or engine.has_unfinished_requests():
        if w.requests > w.streams:
            admit = w.streams if first else finished
            joining, pending, finished, first = pending[:admit], pending[admit:], 0, False
        else:
            joining, pending = (pending, []) if not w.arrivals_per_step else (
                pending[:w.arrivals_per_step], pending[w.arrivals_per_step:])
        for rid, ids, params in joining:
            engine.add_request(rid, ids, params)
        in_window = (w.profile_steps is None or (_decoding(engine) and len(window) < w.profile_steps))
        if in_window and prof is not None and not window:
            prof.__enter__()
        t0, c0 = time.perf_counter(), time.process_time()
        finished += sum(1 for out in engine.step() if out.finished)
        if in_window:
            window.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            if prof is not None and w.profile_steps is not None and len(window) == w.profile_steps:
                prof.__exit__(None, None, None)
                prof = None
    if prof is not None and window:
        prof.__exit__(None, None, None)
    return {"steps": len(window), "wall_ms": sum(window) * 1e3, "cpu_ms": sum(cpu) * 1e3}


def profile_in_process(model: str, dtype: str, threads: int, w: Workload) -> dict:
    engine = build_engine(model, dtype, threads)
    for rid, ids, params in _requests(engine, Workload("warm", 2, 64, 4, None), "warm", 99):
        engine.add_request(rid, ids, params)  # first-call set-up, not measured
    while engine.has_unfinished_requests():
        engine.step()
    plain = run_pass(engine, w, "plain", 1)
    ranges = Ranges()
    for attr, kind in (("schedule", "schedule"), ("update", "update")):
        ranges.wrap(engine.scheduler, attr, kind)
    ranges.wrap(engine.runner, "execute", "execute")
    if hasattr(engine.runner, "_attention_metadata"):
        ranges.wrap(engine.runner, "_attention_metadata", "metadata")
    ranges.wrap(engine.runner.model, "compute_logits", "logits")
    ranges.wrap(engine.runner.sampler, "sample", "sample")
    ranges.wrap(engine.output_processor, "process", "process")
    ranges.wrap(engine, "step", "step")
    ranges.hook_modules(engine.runner.model)
    ranges.wrap_kernels()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    profiled = run_pass(engine, w, "prof", 2, prof)
    top_ops: dict[str, dict[str, float]] = {}
    totals, counts, range_counts = attribute(prof.events(), top_ops)
    op_ms, range_ms = profiler_costs()
    steps = max(profiled["steps"], 1)
    step_ms = plain["wall_ms"] / max(plain["steps"], 1)
    profiled_step_ms = profiled["wall_ms"] / steps
    # Each row net of what the profiler and this script's ranges cost (measured per recorded op
    # and per range on trivial ones); what the rows leave of the unprofiled step is unattributed.
    ms = {row: max(0.0, (totals.get(row, 0.0) / 1e3 - op_ms * counts.get(row, 0)
                         - range_ms * range_counts.get(row, 0)) / steps) for row in ROWS}
    ms[UNATTRIBUTED] = step_ms - sum(ms.values())
    total = sum(v for v in ms.values() if v > 0)
    rows = {row: {"ms_per_step": round(v, 3), "share": round(v / total, 4) if total else 0.0,
                  "raw_profiled_ms_per_step": round(totals.get(row, 0.0) / 1e3 / steps, 3),
                  "ops_per_step": round(counts.get(row, 0) / steps, 1),
                  "ranges_per_step": round(range_counts.get(row, 0) / steps, 1),
                  "top_ops_ms_per_step": {op: round(us / 1e3 / steps, 3) for op, us in sorted(
                      top_ops.get(row, {}).items(), key=lambda kv: -kv[1])[:4]}} for row, v in ms.items()}
    return {
        "workload": asdict(w), "dtype": dtype, "threads": threads,
        "unprofiled": {**plain, "step_ms": round(step_ms, 3),
                       "cpu_step_ms": round(plain["cpu_ms"] / max(plain["steps"], 1), 3)},
        "profiled": {**profiled, "step_ms": round(profiled_step_ms, 3),
                     "profiler_cost_per_op_us": round(op_ms * 1e3, 3),
                     "profiler_cost_per_range_us": round(range_ms * 1e3, 3)},
        "rows": rows,
    }


# ---- HTTP view (py-spy) -------------------------------------------------------------------------

# Innermost frame (leaf to root) whose file matches a pattern names the sample's part.
FRAME_PARTS = [
    (re.compile(r"chatfleet/engine/(models|kernels)/"), "model forward"),
    (re.compile(r"chatfleet/engine/runner/sampler\.py"), "sampling"),
    (re.compile(r"chatfleet/engine/runner/"), "runner (inputs, metadata)"),
    (re.compile(r"chatfleet/engine/(scheduler|scheduling_policy)\.py|chatfleet/engine/kv/"), "scheduler + KV manager"),
    (re.compile(r"chatfleet/engine/(output_processor|tokenizer)\.py|/tokenizers/"), "detokenize, stops, chat template"),
    (re.compile(r"chatfleet/engine/api/|chatfleet/protocol/|/(fastapi|starlette|uvicorn|h11|httptools|pydantic"
                r"|pydantic_core|anyio|orjson|json)/"), "HTTP path (API, SSE, JSON)"),
    (re.compile(r"/asyncio/"), "event loop (asyncio)"),
    (re.compile(r"chatfleet/engine/"), "engine step (other)"),
]


def classify_stack(frames: list[str]) -> str:
    for frame in reversed(frames):
        for pattern, part in FRAME_PARTS:
            if pattern.search(frame):
                return part
    return "other (threads, imports)"


def parse_raw(text: str) -> dict[str, int]:
    """py-spy's raw (collapsed) output -> samples per part."""
    counts: dict[str, int] = defaultdict(int)
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        counts[classify_stack(frames[1:] if frames[0].startswith(("thread", "process")) else frames)] += int(n)
    return dict(counts)


def profile_http(model_dir: Path, dtype: str, threads: int, w: Workload, rate: int, log_dir: Path) -> dict:
    backend = BACKENDS["ours"]
    port = free_port()
    spec = backend.launch(model_dir, port, threads, 256 << 20, 4096, dtype)
    log = log_dir / f"profile_step-{dtype}-{w.name}.log"
    raw = log_dir / f"profile_step-{dtype}-{w.name}.pyspy.txt"
    prompts = PromptFactory(model_dir, seed=3)
    force = backend.force_length(w.output_tokens)

    def body(n: int) -> dict:
        return {"model": spec.request_model, "messages": [{"role": "user", "content": prompts.make(n)}],
                "temperature": 0.0, **force}

    with ServerProcess("ours", spec.argv, port, spec.env, log) as server:
        server.wait_healthy(timeout_s=600)
        asyncio.run(closed_loop(server.base_url, [body(w.prompt_tokens) for _ in range(4)], 4))  # warm-up
        assert server.proc is not None
        spy = subprocess.Popen([str(PY_SPY), "record", "-p", str(server.proc.pid), "-r", str(rate), "--format",
                                "raw", "-o", str(raw), "--nonblocking", "--subprocesses"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attached before the load starts
        bodies = [body(w.prompt_tokens) for _ in range(max(2 * w.streams, w.requests))]
        phase = asyncio.run(closed_loop(server.base_url, bodies, w.streams))
        spy.send_signal(signal.SIGINT)
        _, err = spy.communicate(timeout=60)
    counts = parse_raw(raw.read_text()) if raw.exists() else {}
    total = sum(counts.values())
    return {
        "workload": asdict(w), "dtype": dtype, "threads": threads, "samples": total, "rate_hz": rate,
        "pyspy_raw": str(raw), "pyspy_error": None if raw.exists() else err.decode(errors="replace")[-400:],
        "output_tokens_per_s": phase.output_tokens_per_s, "ttft_p50_ms": phase.ttft_p50_ms,
        "itl_mean_ms": phase.itl_mean_ms,
        "shares": {part: round(n / total, 4) for part, n in sorted(counts.items(), key=lambda kv: -kv[1])}
        if total else {},
    }


# ---- report -------------------------------------------------------------------------------------

def print_in_process(results: list[dict], console: Console) -> None:
    table = Table(title="engine step, in process (torch.profiler, ms per step net of the profiler's per-event cost)")
    table.add_column("part", no_wrap=True)
    for r in results:
        table.add_column(f"{r['workload']['name']} {r['dtype']}\nms/step (share)", justify="right")
    for row in REPORT_ROWS:
        table.add_row(row, *(f"{r['rows'][row]['ms_per_step']:.2f} ({100 * r['rows'][row]['share']:.0f}%)"
                             for r in results))
    table.add_row("step, unprofiled (wall / cpu)", *(f"{r['unprofiled']['step_ms']:.1f} / "
                                                      f"{r['unprofiled']['cpu_step_ms']:.1f}" for r in results))
    table.add_row("step, profiled (wall)", *(f"{r['profiled']['step_ms']:.1f}" for r in results))
    console.print(table)


def print_http(results: list[dict], console: Console) -> None:
    parts = sorted({p for r in results for p in r["shares"]},
                   key=lambda p: -max(r["shares"].get(p, 0) for r in results))
    table = Table(title="`chatfleet engine` over HTTP (py-spy samples of the server, share of non-idle time)")
    table.add_column("part", no_wrap=True)
    for r in results:
        table.add_column(f"{r['workload']['name']} {r['dtype']}", justify="right")
    for p in parts:
        table.add_row(p, *(f"{100 * r['shares'].get(p, 0):.0f}%" for r in results))
    table.add_row("samples", *(str(r["samples"]) for r in results))
    table.add_row("output tok/s", *(f"{r['output_tokens_per_s']:.0f}" for r in results))
    table.add_row("TTFT p50 ms", *(f"{r['ttft_p50_ms']:.0f}" if r["ttft_p50_ms"] is not None else "-"
                                   for r in results))
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--dtypes", help="comma list (default: float32, plus bfloat16 where the CPU has it natively)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (in process) and the server's --threads")
    p.add_argument("--workloads", default="decode,prefill", help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--skip-http", action="store_true", help="only the in-process view")
    p.add_argument("--skip-in-process", action="store_true", help="only the HTTP view")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",")] if args.dtypes else default_dtypes()
    workloads = [WORKLOADS[n.strip()] for n in args.workloads.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    from chatfleet.engine.builtin_models.tiny import resolve_model

    model_dir = Path(resolve_model(args.model))
    machine = describe_machine(threads_used=args.threads)
    console = Console(width=170)
    console.print(f"machine: {one_line(machine)}")
    result: dict = {"benchmark": "profile_step", "model": args.model, "machine": machine,
                    "torch": torch.__version__, "in_process": [], "http": []}
    if not args.skip_in_process:
        for dtype in dtypes:
            for w in workloads:
                result["in_process"].append(profile_in_process(args.model, dtype, args.threads, w))
        print_in_process(result["in_process"], console)
    if not args.skip_http:
        if not PY_SPY.exists():
            console.print(f"[yellow]no py-spy at {PY_SPY}: pip install py-spy (skipping the HTTP view)")
        else:
            log_dir = RESULTS_DIR / "logs"
            log_dir.mkdir(parents=True, exist_ok=True)
            for dtype in dtypes:
                for w in workloads:
                    if w.new_tokens:  # one-message chats over HTTP: no returning turns there
                        continue
                    result["http"].append(profile_http(model_dir, dtype, args.threads, w, args.rate, log_dir))
            print_http(result["http"], console)
    result["machine"]["load_average_at_end"] = load_average()
    out = args.out or RESULTS_DIR / f"profile_step-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
