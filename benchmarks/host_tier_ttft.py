"""A returning turn's TTFT: history reloaded from the host tier vs recomputed vs a device hit.

One conversation of ``--history`` tokens runs a turn; a second conversation of the same size
then takes the device pool (sized for about one of them), evicting the first; the first comes
back with ``--new`` more tokens. Three engines on one loaded model, side by side in one run,
each repeated ``--repeats`` times (median reported):

- recompute: stock, no host tier: the evicted history is computed again;
- host: ``--host-cache-memory`` sized for both conversations: the history is loaded back;
- device: a device pool large enough that nothing is evicted (the best case).

Usage: python benchmarks/host_tier_ttft.py --model small --history 3072 --repeats 3
Prints a table and writes JSON under benchmarks/results/.
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

from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.torch_runner import TorchRunner

RESULTS = Path(__file__).resolve().parent / "results"
BS = 16
REPLY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def make_engine(loaded, model: str, device_tokens: int, host_bytes: int, max_len: int) -> Engine:
    cache = CacheConfig(block_size=BS, num_tokens=device_tokens, host_memory_bytes=host_bytes)
    config = EngineConfig(model=model, max_model_len=max_len, cache=cache,
                          scheduler=SchedulerConfig(max_batched_tokens=2048))
    spec = loaded.config.kv_cache_spec(BS, "float32")
    device = cache.plan_pools(spec).pools[0].num_blocks
    host_plan = cache.plan_host_pools(spec)
    host = host_plan.pools[0].num_blocks if host_plan is not None else 0
    return Engine(config, runner=TorchRunner(loaded, device, BS, num_host_blocks=host),
                  tokenizer=loaded.tokenizer)


def run(engine: Engine, rid: str, prompt: list[int], params: SamplingParams) -> tuple[float, list[int], int]:
    """Seconds to the first token, all tokens, cached tokens."""
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ttft, tokens, cached = None, [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - start
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    assert ttft is not None
    return ttft, tokens, cached


def returning_turn(engine: Engine, rng: random.Random, vocab: int, history: int, new: int, tag: str) -> dict:
    conv = [rng.randrange(vocab) for _ in range(history)]
    other = [rng.randrange(vocab) for _ in range(history)]
    _, reply, _ = run(engine, f"{tag}-a1", conv, REPLY)
    run(engine, f"{tag}-b1", other, REPLY)  # takes the device pool
    back = conv + reply + [rng.randrange(vocab) for _ in range(new)]
    before = engine.stats()
    ttft, tokens, cached = run(engine, f"{tag}-a2", back, FIRST)
    after = engine.stats()
    return {
        "ttft_s": ttft, "prompt_tokens": len(back), "cached_tokens": cached, "first_token": tokens[0],
        "promoted_blocks": (after.host_promotions or 0) - (before.host_promotions or 0),
        "load_seconds": (after.kv_seconds_loading or 0.0) - (before.kv_seconds_loading or 0.0),
        "store_seconds": (after.kv_seconds_storing or 0.0) - (before.kv_seconds_storing or 0.0),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--history", type=int, default=3072, help="tokens of the conversation so far")
    ap.add_argument("--new", type=int, default=32, help="tokens of the returning user turn")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model(args.model), dtype="float32")
    vocab = loaded.config.vocab_size
    per_token = loaded.config.kv_cache_spec(BS, "float32").bytes_per_token
    max_len = args.history * 2 + 512
    fits_one = args.history + args.new + 256  # one conversation, not two
    setups = {
        "recompute": dict(device_tokens=fits_one, host_bytes=0),
        "host": dict(device_tokens=fits_one, host_bytes=per_token * 3 * (args.history + 256)),
        "device": dict(device_tokens=4 * (args.history + 256), host_bytes=0),
    }
    engines = {name: make_engine(loaded, args.model, max_len=max_len, **kw) for name, kw in setups.items()}
    rows: dict[str, list[dict]] = {name: [] for name in setups}
    for rep in range(args.repeats + 1):  # the first round warms up allocators and kernels
        for name, engine in engines.items():  # interleaved: noise hits every setup alike
            result = returning_turn(engine, random.Random(rep), vocab, args.history, args.new, f"{name}{rep}")
            engine.check_integrity()
            if rep:
                rows[name].append(result)
    firsts = {name: {r["first_token"] for r in rs} for name, rs in rows.items()}
    same_output = all(
        len({rows[n][i]["first_token"] for n in rows}) == 1 for i in range(args.repeats)
    )
    med = {name: statistics.median(r["ttft_s"] for r in rs) for name, rs in rows.items()}
    print(f"model {args.model}, history {args.history} tokens + {args.new} new, KV {per_token} B/token,"
          f" {args.threads} thread(s), median of {args.repeats} (machine shared: ratios, not absolutes)")
    print(f"{'setup':<10} {'TTFT ms':>9} {'x recompute':>12} {'cached tok':>11} {'promoted blk':>13}"
          f" {'load ms':>8} {'store ms':>9}")
    for name, rs in rows.items():
        r = rs[-1]
        print(f"{name:<10} {med[name] * 1e3:9.1f} {med['recompute'] / med[name]:12.1f} {r['cached_tokens']:>11}"
              f" {r['promoted_blocks']:>13} {statistics.median(x['load_seconds'] for x in rs) * 1e3:8.2f}"
              f" {statistics.median(x['store_seconds'] for x in rs) * 1e3:9.2f}")
    print(f"same greedy first token in every setup: {same_output}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"host_tier_ttft_{int(time.time())}.json"
    out.write_text(json.dumps({
        "args": vars(args), "kv_bytes_per_token": per_token, "median_ttft_s": med,
        "speedup_host_vs_recompute": med["recompute"] / med["host"], "same_output": same_output,
        "first_tokens": {k: sorted(v) for k, v in firsts.items()}, "runs": rows,
    }, indent=2))
    print(f"wrote {out}")
    return 0 if same_output else 1


if __name__ == "__main__":
    sys.exit(main())
