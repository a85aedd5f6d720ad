"""Against the real built-in engine (tiny model, one torch thread per engine): a sweep finds a
knee and a smaller KV pool gives a lower one; prefix caching raises the hit rate by turn."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from chatfleet.bench.client import ClientConfig
from chatfleet.bench.dists import make
from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.sweep import Bench, RunProtocol, SweepSpec, sweep
from chatfleet.bench.tokens import load_counter
from chatfleet.bench.workload import Workload, get_profile
from chatfleet.testing.engines import launch_engine

# Longer replies than cpu-roleplay so that a request queued behind a full pool waits visibly.
PROFILE = get_profile("cpu-roleplay").with_overrides(reply_tokens=make("uniform", low=30, high=40))
ENGINES = {
    "big": ["--kv-cache-tokens", "16384"],
    "small": ["--kv-cache-tokens", "1024"],  # one or two chats' requests fit at a time
    "nocache": ["--kv-cache-tokens", "16384", "--no-prefix-cache"],
}


@pytest.fixture(scope="module")
def engines():
    procs = {name: launch_engine("tiny", args, threads=1) for name, args in ENGINES.items()}
    try:
        with ThreadPoolExecutor(len(procs)) as ex:
            list(ex.map(lambda p: p.start(), procs.values()))
        yield {name: p.url for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def counter():
    return load_counter("tiny")


def bench(url, counter, load, slo="ttft_p90<=10s"):
    proto = RunProtocol(url, load, parse_slo(slo), base_seed=11)
    return Bench(proto, ClientConfig("tiny"), lambda seed: Workload(PROFILE, seed, counter))


def run_sweep(url, counter, slo, max_level):
    async def go():
        b = bench(url, counter, LoadSpec("concurrency", 1, duration_s=2.0, warmup_s=0.5), slo)
        try:
            return await sweep(b, SweepSpec(start=1, max_level=max_level, growth=2.0, resolution=1, max_points=8))
        finally:
            await b.close()

    return asyncio.run(go())


def run_point(url, counter, load):
    async def go():
        b = bench(url, counter, load)
        try:
            return await b.run_point(load.level)
        finally:
            await b.close()

    return asyncio.run(go())


def test_sweep_finds_a_knee_and_a_smaller_pool_gives_a_lower_one(engines, counter):
    # The SLO is set from this machine's own single-chat reply time, so a slow or busy CI box does
    # not move the knee: alone, a request's TTFT is a small part of its reply (35 tokens); queued
    # behind a full pool it waits whole replies of others.
    base = run_point(engines["big"], counter, LoadSpec("concurrency", 1, duration_s=1.5, warmup_s=0.5))
    reply1 = base.runs[0].summary.latency["reply"]["p50"]
    threshold = max(0.05, 2 * reply1)
    slo = f"ttft_p90<={threshold * 1e3:.0f}ms"
    small = run_sweep(engines["small"], counter, slo, max_level=16)
    big = run_sweep(engines["big"], counter, slo, max_level=16)
    assert small.knee_reached and small.knee is not None, [(p.level, p.passed) for p in small.points]
    assert big.knee is not None
    assert small.knee < big.knee, (slo, small.knee, big.knee)
    print(f"SLO {slo}: knee {small.knee:g} with a 1024-token pool, {big.knee:g} with 16384")
    # Every run started from a verified empty cache with its own seed.
    runs = [r for s in (small, big) for p in s.points for r in p.runs]
    assert all(r.reset.method == "usage" and r.reset.cached_after == 0 for r in runs)
    for s in (small, big):
        seeds = [r.seed for p in s.points for r in p.runs]
        assert len(set(seeds)) == len(seeds)
    # Forced reply lengths held and nothing failed.
    recs = [rec for r in runs for rec in r.records if not rec.warmup]
    assert all(rec.status == "ok" and rec.output_tokens == rec.expected_tokens for rec in recs)


def test_hit_rate_by_turn_is_higher_with_prefix_caching(engines, counter):
    load = LoadSpec("closed", 4, duration_s=3.0, warmup_s=0.0)
    on = run_point(engines["big"], counter, load).runs[0].summary
    off = run_point(engines["nocache"], counter, load).runs[0].summary
    assert off.hits_by_turn and all(h.cached_tokens == 0 for h in off.hits_by_turn.values())
    turns = sorted(set(on.hits_by_turn) & set(off.hits_by_turn))
    assert len(turns) >= 2
    assert all(on.hits_by_turn[t].hit_rate > off.hits_by_turn[t].hit_rate for t in turns)
    # Later turns reuse the card and the whole history: most of the prompt is cached.
    assert np.mean([on.hits_by_turn[t].hit_rate for t in turns if t >= 1]) > 0.5
