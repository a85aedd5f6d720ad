"""The quality gate of the engine's bf16 configuration against its 32-bit one, and each suite's
wall time.

Two `chatfleet engine` processes on the same model folder (``--dtype float32`` as the baseline,
``--dtype bfloat16`` as the candidate), started through the project's one engine launcher, then
`chatfleet gate`'s runner in this process; default suite: role-play likelihood.

    PYTHONPATH=src python benchmarks/gate_precision.py [--model small] [--suite roleplay,tools]

Prints a table (suite, verdict, decision, wall time) and writes
benchmarks/results/gate_precision.json plus the gate's own files under
benchmarks/results/gate_precision/. The machine may be shared: wall times are of this run only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from chatfleet.gate.report import write_outputs
from chatfleet.gate.runner import GateConfig, ServerSpec, run_gate
from chatfleet.gate.suite import SuiteSettings
from chatfleet.testing.engines import launch_engine

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--suite", default="roleplay")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--gsm8k", type=Path, default=None)
    ap.add_argument("--gsm8k-fewshot", type=Path, default=None)
    ap.add_argument("--gsm8k-limit", type=int, default=None)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "gate_precision.json")
    a = ap.parse_args()
    engines = {dtype: launch_engine(a.model, ["--dtype", dtype], threads=a.threads, log_dir=a.out.parent,
                                    log_name=f"gate-engine-{dtype}")
               for dtype in ("float32", "bfloat16")}
    try:
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda e: e.start(), engines.values()))
        config = GateConfig(ServerSpec(engines["float32"].url), ServerSpec(engines["bfloat16"].url),
                            suites=tuple(a.suite.split(",")),
                            settings=SuiteSettings(gsm8k_path=a.gsm8k, gsm8k_fewshot_path=a.gsm8k_fewshot,
                                                   gsm8k_limit=a.gsm8k_limit))
        outcome = asyncio.run(run_gate(config))
    finally:
        for e in engines.values():
            e.stop()
    files = write_outputs(config, outcome, a.out.with_suffix(""))
    print(f"{'suite':10} {'verdict':8} {'wall s':>8}  decision")
    for name, r in outcome.suites.items():
        print(f"{name:10} {r.verdict.value:8} {r.wall_s:8.1f}  {r.reason}")
    print(f"gate: {outcome.verdict.value} (exit {outcome.exit_code}) in {outcome.wall_s:.1f} s")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"model": a.model, "baseline": "--dtype float32", "candidate": "--dtype bfloat16",
                                 **outcome.summary(config)}, indent=2))
    print(f"wrote {a.out} and {files['report']}")


if __name__ == "__main__":
    main()
