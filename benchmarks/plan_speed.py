"""How fast the planner simulates: CPU seconds per simulated hour of chat traffic.

The workload is the bench's ``seed-roleplay`` profile (5.5K-token requests on average, ~20 turns,
~20 s pauses) as an open loop of new chats at ``--chats`` per simulated hour, served by
simulated replicas of a Qwen3-8B-shaped model on an H100 (BF16 weights, 0.9 of memory): one
replica alone (``--replicas 1``: far past its knee at 2,200 chats/h), or a fleet behind the
gateway's routing and admission (``--replicas 3``: the fleet that meets ttft_p99<=2s at 2,200
chats/h); the real scheduler, KV manager and engine loop run every step. A shorter
``--minutes`` window is simulated and the rate extrapolated (both are printed). Writes JSON
under benchmarks/results/.

    python benchmarks/plan_speed.py --minutes 60 --token-scale 1 --replicas 1 3
    python benchmarks/plan_speed.py --minutes 60 --token-scale 1 --replicas 3 --decode-spans on off   # side by side

Each token scale runs the same traffic (``--token-scale 8``: coarse time, see plan/cost_model.py);
latency percentiles, the hit rate and whether the SLO held are printed beside the speed.
CPU seconds (process time) are printed beside wall seconds: the machine may be shared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path

from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.tokens import EstimateCounter
from chatfleet.bench.workload import Workload, get_profile
from chatfleet.engine.config import SchedulerConfig
from chatfleet.plan.catalog import load_catalog
from chatfleet.plan.replica_setup import ServingConfig, replica_plan
from chatfleet.plan.sim_bench import ReplicaPlan, sim_protocol
from chatfleet.plan.sim_fleet import FleetBench
from chatfleet.plan.virtual_loop import VirtualClock, run_virtual

QWEN3_8B = {"model_type": "qwen3", "head_dim": 128, "hidden_size": 4096, "intermediate_size": 12288,
            "max_position_embeddings": 40960, "num_attention_heads": 32, "num_hidden_layers": 36,
            "num_key_value_heads": 8, "tie_word_embeddings": False, "vocab_size": 151936}


SLO = "ttft_p99<=2s"


def simulate(load: LoadSpec, make_workload, plan: ReplicaPlan, replicas: int):
    """One simulated run at ``load``: a single replica (``SimBench``, as ``chatfleet plan sweep``)
    or a fleet of ``replicas`` behind the gateway's code (``FleetBench``, as ``plan fleet``)."""
    from chatfleet.plan.sim_bench import SimBench

    clock = VirtualClock()
    proto = sim_protocol(load, parse_slo(SLO))
    bench = SimBench(proto, make_workload, plan, clock) if replicas == 1 else \
        FleetBench(proto, make_workload, plan, clock, replicas)
    return run_virtual(bench.run_point(load.level), clock)


def fingerprint(records) -> str:
    """A digest of every record's outcome (times, gaps, tokens, cached tokens, status): two runs
    of the same traffic print the same digest only where the planner's effects are identical."""
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps([r.conv_id, r.turn, r.sent_s, r.first_token_s, r.end_s, r.itl_s, r.output_tokens,
                             r.prompt_tokens, r.cached_tokens, r.status], separators=(",", ":")).encode())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=float, default=2200, help="new chats per simulated hour")
    ap.add_argument("--minutes", type=float, default=5.0, help="simulated minutes to run")
    ap.add_argument("--gpu", default="H100")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 3],
                    help="1: one replica alone; N > 1: a fleet of N behind the gateway's routing")
    ap.add_argument("--token-scale", type=int, nargs="+", default=[1])
    ap.add_argument("--decode-spans", nargs="+", default=["on"], choices=["on", "off"],
                    help="run plain decode steps through engine/decode_span.py (same results) or the engine's step")
    ap.add_argument("--out", default="benchmarks/results/plan_speed.json")
    args = ap.parse_args()
    gpu = load_catalog().get(args.gpu)
    profile = get_profile("seed-roleplay")
    counter = EstimateCounter()
    load = LoadSpec("open", args.chats / 3600.0, duration_s=args.minutes * 60, warmup_s=0.0, drain_timeout_s=0.0)
    sim_s = args.minutes * 60
    rows = []
    print(f"{'replicas':>8} {'scale':>5} {'spans':>5} {'simulated':>9} {'wall':>7} {'cpu':>7} {'requests':>8}"
          f" {'out tokens':>10} {'cpu per sim hour':>16} {'ttft p50/p99 ms':>16} {'itl p50/p99 ms':>15}"
          f" {'hit rate':>8} {'SLO':>4} {'records digest':>16}")
    for n, k, spans in [(n, k, s) for n in args.replicas for k in args.token_scale for s in args.decode_spans]:
        plan = replica_plan(QWEN3_8B, gpu, ServingConfig(budget_bytes=int(0.9 * gpu.memory_bytes) - 2**30,
                                                         scheduler=SchedulerConfig(max_running=512)), token_scale=k)
        plan = replace(plan, decode_spans=spans == "on")
        t, c = time.perf_counter(), time.process_time()
        point = simulate(load, lambda seed: Workload(profile, seed, counter), plan, n)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        run = point.runs[0]
        lat = run.summary.latency
        tokens = sum(r.output_tokens for r in run.records)
        row = {"replicas": n, "token_scale": k, "decode_spans": spans, "chats_per_hour": args.chats,
               "simulated_s": sim_s, "wall_s": wall, "cpu_s": cpu, "requests": len(run.records),
               "conversations": run.conversations, "output_tokens": tokens,
               "cpu_s_per_simulated_hour": cpu * 3600 / sim_s, "wall_s_per_simulated_hour": wall * 3600 / sim_s,
               "ttft_p50": lat["ttft"]["p50"], "ttft_p99": lat["ttft"]["p99"], "itl_p50": lat["itl"]["p50"],
               "itl_p99": lat["itl"]["p99"], "hit_rate": run.summary.hit_rate, "slo": SLO, "passed": point.passed,
               "gpu": gpu.name, "records_digest": fingerprint(run.records)}
        rows.append(row)
        print(f"{n:>8} {k:>5} {spans:>5} {sim_s:>8.0f}s {wall:>6.1f}s {cpu:>6.1f}s {len(run.records):>8} {tokens:>10,}"
              f" {cpu * 3600 / sim_s:>15,.0f}s {lat['ttft']['p50'] * 1e3:>7.0f}/{lat['ttft']['p99'] * 1e3:<8.0f}"
              f" {lat['itl']['p50'] * 1e3:>6.1f}/{lat['itl']['p99'] * 1e3:<8.1f} {run.summary.hit_rate or 0:>8.1%}"
              f" {'met' if point.passed else 'no':>4} {row['records_digest']:>16}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
