"""Host-tier transfers of a returning turn's blocks on this CPU: the one-pass block copy kernel
(``engine/runner/block_copy.py``) against the torch ops it replaces, in the same process.

The caches are the served model's (``small`` by default: 8 layers, 2 KV heads of 64, 16-token
blocks) in the pinned dtype; each round evicts the caches from the CPU's caches (a pass over
512 MiB) before every store and every load, as a step between two turns does, and the two paths
alternate within a round. Blocks are spread over the pool as a running engine's are.

    python benchmarks/host_transfer.py --dtype bfloat16 --blocks 78
    python benchmarks/host_transfer.py --dtype float32 --blocks 16,78,300

Prints a table (median ms and GB/s of the blocks' bytes, per direction and path) and writes
benchmarks/results/host_transfer-<time>.json with the machine.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chatfleet.engine.models.attention import KVCache  # noqa: E402
from chatfleet.engine.outputs import KVTransfer, TransferDirection  # noqa: E402
from chatfleet.engine.runner import block_copy  # noqa: E402
from chatfleet.engine.runner.kv_transfer import HostKVTransfer  # noqa: E402
from machine import describe_machine, one_line  # noqa: E402  (same folder)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--blocks", default="78", help="Comma list: blocks per transfer (78: a 1,248-token history).")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=384, help="Device pool (384: capacity.py's 6,144 tokens).")
    p.add_argument("--host-blocks", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=15)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if not block_copy.available():
        print("the block copy kernel does not build here: nothing to compare", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    shape = (args.kv_heads, args.pool_blocks, args.block_size, args.head_dim)

    def caches() -> list[KVCache]:
        return [KVCache(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.layers)]

    paths = {"torch ops": HostKVTransfer(caches(), args.host_blocks),
             "one-pass kernel": HostKVTransfer(caches(), args.host_blocks)}
    paths["torch ops"]._copier = None
    assert paths["one-pass kernel"]._copier is not None
    evict = torch.empty(512 * 2**20 // 4)
    rng = random.Random(0)
    rows = []
    for n in [int(b) for b in args.blocks.split(",")]:
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            device = rng.sample(range(args.pool_blocks), min(n, args.pool_blocks))
            host = rng.sample(range(args.host_blocks), len(device))
            for name, tier in paths.items():
                for direction in (TransferDirection.STORE, TransferDirection.LOAD):
                    evict.add_(1.0)
                    t0 = time.perf_counter()
                    tier.execute([KVTransfer(direction, tuple(device), tuple(host))])
                    times.setdefault((name, direction.value), []).append(time.perf_counter() - t0)
        nbytes = len(device) * paths["torch ops"].bytes_per_block
        for (name, direction), ts in times.items():
            ms = statistics.median(ts) * 1e3
            rows.append({"blocks": len(device), "bytes": nbytes, "path": name, "direction": direction,
                         "median_ms": ms, "min_ms": min(ts) * 1e3, "gb_per_s": nbytes / ms / 1e6, "rounds": ts})
    machine = describe_machine(threads_used=1)
    table = Table(title=f"host-tier transfers, {args.dtype}, {args.layers} layers x {args.kv_heads} KV heads x "
                        f"{args.head_dim}, {args.block_size}-token blocks, 1 thread, {one_line(machine)}")
    for col in ("blocks", "MB", "direction", "path", "median ms", "GB/s", "kernel / torch"):
        table.add_column(col, justify="right")
    for r in rows:
        peer = next(p for p in rows if p["blocks"] == r["blocks"] and p["direction"] == r["direction"]
                    and p["path"] == "torch ops")
        table.add_row(str(r["blocks"]), f"{r['bytes'] / 1e6:.1f}", r["direction"], r["path"], f"{r['median_ms']:.2f}",
                      f"{r['gb_per_s']:.1f}", f"{r['median_ms'] / peer['median_ms']:.2f}x")
    Console(width=140).print(table)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"host_transfer-{time.strftime('%Y%m%d-%H%M%S')}.json"
    machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    path.write_text(json.dumps({"benchmark": "host_transfer", "args": vars(args), "machine": machine, "rows": rows},
                               indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
