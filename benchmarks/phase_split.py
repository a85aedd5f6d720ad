"""Where a closed-loop throughput phase's wall time goes: prompt steps against decode-only steps, and
the bound that puts on the ratio to a peer (issue 20, point 3).

engine_throughput.py's phases (N streams, each sending its requests one after the other; ~500-token
prompts, distinct per request; 64 output tokens, forced) stepped in process through the real Engine
(scheduler, KV manager, runner, sampler, output processor; no HTTP). Each step is timed and
charged to "prompt" (it carries prompt tokens, decode rows riding along or not) or "decode"
(decode rows only). With `--peer` (an engine_throughput JSON from this machine) the table adds,
per phase, the peer's median wall over its rounds and two bounds: the ratio ours / peer would
reach if every decode-only step cost nothing (the peer's wall over our prompt steps' time), and
the decode step time a ratio of `--target` (1.25) would need with the prompt steps as they are.

  python benchmarks/phase_split.py --dtypes bfloat16,float32 --streams 8,32
  python benchmarks/phase_split.py --peer benchmarks/results/engine_throughput-20261204-172713.json

Prints a table and writes JSON (with the machine) to benchmarks/results/. Run it under the
measurement lock like every timing script.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR  # noqa: E402
from machine import default_dtypes, describe_machine, one_line  # noqa: E402
from profile_step import build_engine  # noqa: E402


@dataclass(frozen=True)
class StepRecord:
    prompt_tokens: int
    decode_rows: int
    seconds: float


@dataclass(frozen=True)
class PhaseSplit:
    dtype: str
    streams: int
    requests: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    prompt_steps: int
    prompt_steps_s: float
    prompt_tokens: int
    decode_steps: int
    decode_steps_s: float
    decode_step_ms_median: float | None


@dataclass(frozen=True)
class PeerBound:
    peer: str
    peer_wall_s: float  # median over the JSON's rounds
    ours_http_wall_s: float | None  # ours over HTTP in the same JSON, for comparison
    ratio_if_decode_free: float
    decode_step_ms_for_target: float | None  # None: the target is out of reach even then


def run_phase(engine, streams: int, per_stream: int, prompt_tokens: int, output_tokens: int,  # noqa: ANN001
              seed: int) -> list[StepRecord]:
    """Step one closed-loop phase through ``engine``; every step's composition and wall time."""
    from chatfleet.engine.request import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_tokens, min_tokens=output_tokens, ignore_eos=True, temperature=0.0)
    left = dict.fromkeys(range(streams), per_stream)
    owner: dict[str, int] = {}

    def send(stream: int) -> None:
        request_id = f"p{seed}-s{stream}-{per_stream - left[stream]}"
        engine.add_request(request_id, [rng.randrange(3, engine.vocab_size) for _ in range(prompt_tokens)], params)
        owner[request_id] = stream
        left[stream] -= 1

    for stream in range(streams):
        send(stream)
    schedule = engine.scheduler.schedule
    plan_shape: list[tuple[int, int]] = []

    def recording_schedule():  # noqa: ANN202 - the scheduler's own return type
        plan = schedule()
        prompt = sum(len(c.token_ids) for c in plan.chunks if len(c.token_ids) > 1)
        plan_shape.append((prompt, sum(1 for c in plan.chunks if len(c.token_ids) == 1)))
        return plan

    engine.scheduler.schedule = recording_schedule
    records: list[StepRecord] = []
    try:
        while engine.has_unfinished_requests():
            plan_shape.clear()
            start = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - start
            prompt, rows = plan_shape[-1] if plan_shape else (0, 0)
            records.append(StepRecord(prompt, rows, seconds))
            for out in outputs:
                if out.finished and left[owner[out.request_id]] > 0:
                    send(owner.pop(out.request_id))
    finally:
        engine.scheduler.schedule = schedule
    return records


def split(dtype: str, streams: int, per_stream: int, output_tokens: int, records: list[StepRecord]) -> PhaseSplit:
    prompt = [r for r in records if r.prompt_tokens]
    decode = [r for r in records if not r.prompt_tokens and r.decode_rows]
    wall = sum(r.seconds for r in records)
    requests = streams * per_stream
    return PhaseSplit(
        dtype=dtype, streams=streams, requests=requests, output_tokens=requests * output_tokens,
        wall_s=round(wall, 4), output_tokens_per_s=round(requests * output_tokens / wall, 2),
        prompt_steps=len(prompt), prompt_steps_s=round(sum(r.seconds for r in prompt), 4),
        prompt_tokens=sum(r.prompt_tokens for r in prompt),
        decode_steps=len(decode), decode_steps_s=round(sum(r.seconds for r in decode), 4),
        decode_step_ms_median=round(statistics.median(r.seconds for r in decode) * 1e3, 3) if decode else None,
    )


def peer_walls(peer_json: dict, dtype: str, backend: str, concurrency: int) -> list[float]:
    """The wall seconds of ``backend``'s phase at ``concurrency`` in every round of an engine_throughput JSON."""
    entry = peer_json.get("dtypes", {}).get(dtype, {}).get("backends", {}).get(backend)
    if not entry:
        return []
    return [p["wall_s"] for r in entry.get("rounds", [entry]) for p in r.get("phases", [])
            if p["concurrency"] == concurrency and not p.get("failed")]


def bound(phase: PhaseSplit, peer_json: dict, peer: str, target: float) -> PeerBound | None:
    walls = peer_walls(peer_json, phase.dtype, peer, phase.streams)
    if not walls or not phase.prompt_steps_s:
        return None
    peer_wall = statistics.median(walls)
    ours = peer_walls(peer_json, phase.dtype, "ours", phase.streams)
    room = peer_wall / target - phase.prompt_steps_s
    needed = room / phase.decode_steps * 1e3 if room > 0 and phase.decode_steps else None
    return PeerBound(
        peer=peer, peer_wall_s=round(peer_wall, 4),
        ours_http_wall_s=round(statistics.median(ours), 4) if ours else None,
        ratio_if_decode_free=round(peer_wall / phase.prompt_steps_s, 3),
        decode_step_ms_for_target=round(needed, 3) if needed is not None else None,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--dtypes", help="comma list (default: float32, plus bfloat16 where the CPU has it natively)")
    p.add_argument("--streams", default="1,8,32", help="comma list of concurrent streams (phases)")
    p.add_argument("--requests-per-stream", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-gib", type=float, default=0.25)
    p.add_argument("--peer", type=Path, help="an engine_throughput JSON from this machine (its vLLM rounds)")
    p.add_argument("--peer-backend", default="vllm")
    p.add_argument("--target", type=float, default=1.25, help="the ratio ours / peer the bound is computed for")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    dtypes = args.dtypes.split(",") if args.dtypes else default_dtypes()
    streams = [int(s) for s in args.streams.split(",")]
    peer_json = json.loads(args.peer.read_text()) if args.peer else None
    machine = describe_machine(threads_used=args.threads)
    rows: list[dict] = []
    for dtype in dtypes:
        engine = build_engine(args.model, dtype, args.threads, int(args.kv_cache_gib * (1 << 30)))
        run_phase(engine, 2, 1, 64, 4, seed=99)  # first-call set-up (kernel builds, oneDNN primitives)
        for n in streams:
            records = run_phase(engine, n, args.requests_per_stream, args.prompt_tokens, args.output_tokens, seed=n)
            phase = split(dtype, n, args.requests_per_stream, args.output_tokens, records)
            peer = bound(phase, peer_json, args.peer_backend, args.target) if peer_json else None
            rows.append({"phase": asdict(phase), "bound": asdict(peer) if peer else None})

    table = Table(title=f"closed-loop phases in process, {args.model}, {args.threads} thread(s); {one_line(machine)}")
    for col in ("dtype", "streams", "wall s", "tok/s", "prompt steps (s, share)", "decode steps (s, median ms)",
                f"{args.peer_backend} wall s", "ours HTTP s", "ratio if decode free", f"decode ms for {args.target}x"):
        table.add_column(col, justify="right")
    for row in rows:
        ph, b = row["phase"], row["bound"]
        table.add_row(
            ph["dtype"], str(ph["streams"]), f"{ph['wall_s']:.2f}", f"{ph['output_tokens_per_s']:.1f}",
            f"{ph['prompt_steps']} ({ph['prompt_steps_s']:.2f}, {ph['prompt_steps_s'] / ph['wall_s']:.0%})",
            f"{ph['decode_steps']} ({ph['decode_steps_s']:.2f}, {ph['decode_step_ms_median'] or 0:.1f})",
            f"{b['peer_wall_s']:.2f}" if b else "-",
            f"{b['ours_http_wall_s']:.2f}" if b and b["ours_http_wall_s"] else "-",
            f"{b['ratio_if_decode_free']:.2f}x" if b else "-",
            (f"{b['decode_step_ms_for_target']:.1f}" if b["decode_step_ms_for_target"] is not None else "out of reach")
            if b else "-",
        )
    Console(width=200).print(table)
    out = args.out or RESULTS_DIR / f"phase_split-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "phase_split", "settings": {k: str(v) for k, v in vars(args).items()},
                               "machine": machine, "peer_file": str(args.peer) if args.peer else None,
                               "rows": rows, "load_average_at_end": describe_machine()["load_average"]}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
