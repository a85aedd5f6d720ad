"""The eviction experiment, replayed: 24 multi-turn sessions whose working set sits between
8,192 and 16,384 tokens; prefix-cache hit rate per turn for each eviction policy at 8,192 and
16,384 device tokens, with and without a host tier.

What runs: the real engine (``Engine``: scheduler, KV manager, eviction policies from their
registry, host tier, scheduling policy) on the ``SimRunner`` under a virtual clock
(``chatfleet.bench.replay``). Hit rates depend on which blocks stay cached, not on compute, so
the model is the SimRunner and time is a step-cost model; a run takes about a second.

    python benchmarks/eviction_replay.py                 # every registered policy
    python benchmarks/eviction_replay.py --policies lru,session --host-tokens 16384

Prints a table (hit rate per turn) and writes benchmarks/results/eviction_replay-<time>.json.
The target it checks: at 8,192 tokens, ``session`` eviction keeps at least half the hit rate the
16,384-token pool reaches at turns 5 and 6.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from chatfleet.bench.dists import make
from chatfleet.bench.replay import ReplayConfig, ReplayResult, TraceSpec, make_trace, replay, working_set_tokens
from chatfleet.engine.kv.eviction_policies import EVICTION_POLICIES

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TARGET_TURNS = (5, 6)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=None, help="Comma-separated eviction policies (default: all registered).")
    p.add_argument("--device-tokens", default="8192,16384", help="Device pool sizes to replay.")
    p.add_argument("--host-tokens", type=int, default=16384, help="Host tier size for the 'with host' rows (0: none).")
    p.add_argument("--scheduling-policy", default="fcfs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sessions", type=int, default=TraceSpec.num_sessions)
    p.add_argument("--turns", type=int, default=TraceSpec.num_turns)
    p.add_argument("--pause-mean", type=float, default=8.0, help="Mean pause between turns (virtual seconds).")
    p.add_argument("--pause-sigma", type=float, default=0.5,
                   help="Lognormal sigma of the pauses (small: sessions return in near round-robin order).")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/...).")
    return p.parse_args(argv)


def configs(args: argparse.Namespace) -> list[ReplayConfig]:
    policies = args.policies.split(",") if args.policies else EVICTION_POLICIES.names
    out = []
    for device in (int(x) for x in args.device_tokens.split(",")):
        for host in sorted({0, args.host_tokens}):
            for pol in policies:
                out.append(ReplayConfig(device, host, pol, pol, args.scheduling_policy))
    return out


def target_check(results: list[ReplayResult]) -> dict:
    """session @ 8,192 (no host) vs the 16,384-token pool (best policy, no host) at turns 5 and 6."""
    def find(policy: str | None, device: int) -> list[ReplayResult]:
        return [r for r in results if r.config.device_tokens == device and not r.config.host_tokens
                and (policy is None or r.config.eviction_policy == policy)]

    def at_turns(r: ReplayResult) -> float:
        by = r.hit_rate_by_turn()
        vals = [by[t] for t in TARGET_TURNS if t in by]
        return sum(vals) / len(vals) if vals else float("nan")

    small, big = find("session", 8192), find(None, 16384)
    if not small or not big:
        return {"checked": False, "why": "needs the 'session' policy at 8,192 and any policy at 16,384 tokens"}
    got, ref = at_turns(small[0]), max(at_turns(r) for r in big)
    return {"checked": True, "turns": list(TARGET_TURNS), "session_8192": got, "pool_16384": ref,
            "ratio": got / ref if ref else float("nan"), "target_ratio": 0.5, "met": got >= 0.5 * ref}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = TraceSpec(num_sessions=args.sessions, num_turns=args.turns,
                     pause_s=make("lognormal", mean=args.pause_mean, sigma=args.pause_sigma, min=1.0, max=60.0),
                     start_spread_s=args.pause_mean)
    sessions = make_trace(spec, args.seed)
    ws = {"final": working_set_tokens(sessions), **{f"turn_{t}": working_set_tokens(sessions, t) for t in TARGET_TURNS}}
    print(f"{len(sessions)} sessions x {spec.num_turns} turns; working set {ws['final']:,} tokens at the end, "
          + ", ".join(f"{ws[f'turn_{t}']:,} after turn {t}" for t in TARGET_TURNS)
          + " (real engine code path: Engine + SimRunner, virtual clock)")
    results = []
    for cfg in configs(args):
        t0 = time.perf_counter()
        res = replay(sessions, cfg)
        results.append(res)
        print(f"  {cfg.label}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    turns = list(range(spec.num_turns))
    head = f"{'policy @ device tokens (+ host)':<44}" + "".join(f"{'t' + str(t):>7}" for t in turns) + f"{'all':>7}"
    print(head)
    print("-" * len(head))
    for r in results:
        by = r.hit_rate_by_turn()
        print(f"{r.config.label:<44}" + "".join(f"{by.get(t, float('nan')):>7.3f}" for t in turns)
              + f"{r.hit_rate:>7.3f}")
    check = target_check(results)
    if check["checked"]:
        verdict = "met" if check["met"] else "MISSED"
        print(f"target (turns 5-6): session @ 8,192 = {check['session_8192']:.3f} vs 16,384-token pool "
              f"{check['pool_16384']:.3f}: ratio {check['ratio']:.2f} (>= 0.50 wanted): {verdict}")
    else:
        print(f"target not checked: {check['why']}")
    doc = {"benchmark": "eviction_replay", "created_unix": time.time(), "argv": sys.argv[1:],
           "code_path": "chatfleet.engine.Engine with SimRunner (virtual clock)",
           "trace": {**{k: (str(v) if not isinstance(v, (int, float)) else v) for k, v in asdict(spec).items()},
                     "seed": args.seed, "working_set_tokens": ws},
           "results": [{"config": {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v)
                                   for k, v in asdict(r.config).items()},
                        "label": r.config.label, "hit_rate": r.hit_rate,
                        "hit_rate_by_turn": {str(k): v for k, v in r.hit_rate_by_turn().items()},
                        "virtual_s": r.virtual_s, "steps": r.steps} for r in results],
           "target": check}
    out = args.out or RESULTS_DIR / time.strftime("eviction_replay-%Y%m%d-%H%M%S.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, allow_nan=True))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
