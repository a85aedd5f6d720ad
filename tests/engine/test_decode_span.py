"""Decode spans (``engine/decode_span.py``), the planner's fast path owned by the engine: many
plain steps at once with exactly ``step()``'s effects. The oracle is the engine's own step: the
same simulated runs with spans on and off must give identical records, and a span refuses to
open where it cannot run the scheduler's plan (several KV pools, content checks on)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.tokens import EstimateCounter
from chatfleet.bench.workload import Workload, get_profile
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.decode_span import DecodeSpan
from chatfleet.engine.engine import Engine
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.sim_runner import SimRunner
from chatfleet.plan.catalog import load_catalog
from chatfleet.plan.memory_report import read_model_config
from chatfleet.plan.replica_setup import ServingConfig, replica_plan
from chatfleet.plan.sim_bench import sim_protocol, simulate_point
from chatfleet.plan.sim_fleet import FleetBench
from chatfleet.plan.sim_replica import SIM_VOCAB, NullTokenizer
from chatfleet.plan.virtual_loop import VirtualClock, run_virtual

PROFILE = get_profile("cpu-roleplay")


def _make(seed: int) -> Workload:
    return Workload(PROFILE, seed, EstimateCounter())


@pytest.mark.parametrize("host,policy,mixed", [(0, "fcfs", None), (2 * 2**20, "fcfs", None), (0, "lpm", None),
                                               (0, "fcfs", 24)])
def test_decode_spans_change_nothing_in_a_simulated_run(host, policy, mixed, monkeypatch):
    """The same run with decode spans on and off: every record (times, gaps, hits) identical;
    with lpm (not head-of-line) the spans' steps run the scheduler's admission every step; with
    a mixed-step budget the spans cut prompt chunks beside their lanes as ``schedule`` does."""
    span_steps = []
    step = DecodeSpan.step
    monkeypatch.setattr(DecodeSpan, "step", lambda self: span_steps.append(1) or step(self))

    cfg, _ = read_model_config("small")
    serving = ServingConfig(weights="fp32", kv_cache_tokens=1024, host_cache_bytes=host,
                            scheduler=SchedulerConfig(max_running=6, policy=policy, mixed_step_tokens=mixed))
    plan = replica_plan(cfg, load_catalog().get("cpu"), serving)
    proto = sim_protocol(LoadSpec("closed", 8, duration_s=20, warmup_s=2), parse_slo("ttft_p99<=2s"))

    def records(spans: bool):
        res = simulate_point(proto, 8, lambda seed: Workload(get_profile("cpu-roleplay"), seed, EstimateCounter()),
                             replace(plan, decode_spans=spans))
        return [(r.conv_id, r.turn, r.status, r.sent_s, r.first_token_s, r.end_s, r.ttft_s, tuple(r.itl_s),
                 r.cached_tokens, r.prompt_tokens, r.output_tokens) for r in res.points[0].runs[0].records]

    with_spans = records(True)
    assert len(with_spans) > 30 and len(span_steps) > 100
    assert with_spans == records(False)


def test_decode_spans_change_nothing_in_a_fleet(monkeypatch):
    """A fleet's replicas interleave their steps on one loop; a span stays open across the other
    replicas' steps (and arrivals elsewhere), finishes requests and evicts cached blocks itself:
    every record (times, gaps, hits) and the routing must be the same with spans off."""
    seen = {"steps": 0, "finishes": 0, "evictions": 0}
    step = DecodeSpan.step

    def counting_step(self):
        before = self.kv.stats().num_evictions
        cost = step(self)
        if cost is not None:
            seen["steps"] += 1
            seen["finishes"] += len(self.finished)
            seen["evictions"] += self.kv.stats().num_evictions - before
        return cost

    monkeypatch.setattr(DecodeSpan, "step", counting_step)
    cfg, _ = read_model_config("small")
    plan = replica_plan(cfg, load_catalog().get("cpu"), ServingConfig(weights="fp32", kv_cache_tokens=1536,
                                                                      scheduler=SchedulerConfig(max_running=6)))
    proto = sim_protocol(LoadSpec("closed", 12, duration_s=20, warmup_s=2), parse_slo("ttft_p99<=5s"))

    def run(spans: bool):
        clock = VirtualClock()
        bench = FleetBench(proto, _make, replace(plan, decode_spans=spans), clock, 3)
        point = run_virtual(bench.run_point(12.0), clock)
        records = [(r.conv_id, r.turn, r.status, r.sent_s, r.first_token_s, r.end_s, r.ttft_s, tuple(r.itl_s),
                    r.cached_tokens, r.prompt_tokens, r.output_tokens) for r in point.runs[0].records]
        return records, bench.fleet_stats[12.0], clock.now

    with_spans = run(True)
    counted = dict(seen)
    assert len(with_spans[0]) > 60 and counted["steps"] > 300, counted
    assert counted["finishes"] > 10 and counted["evictions"] > 0, counted
    assert with_spans == run(False)
    assert seen == counted  # spans off: no span ran


def _decoding_engine(check_contents: bool) -> tuple[Engine, SimRunner]:
    """An engine whose two requests decode (their prompts computed), plain (forced lengths)."""
    runner = SimRunner(32, 4, vocab_size=SIM_VOCAB, max_model_len=256, check_contents=check_contents)
    engine = Engine(EngineConfig(model="sim", max_model_len=256, cache=CacheConfig(block_size=4, num_tokens=128)),
                    runner=runner, tokenizer=NullTokenizer())
    params = SamplingParams(max_tokens=20, min_tokens=20, ignore_eos=True, temperature=0.0)
    for rid in ("a", "b"):
        engine.add_request(rid, list(range(1, 10)), params)
    engine.step()
    return engine, runner


def test_a_span_runs_the_engines_steps_and_counts_them_as_step_does():
    """Steps through a span then committed leave the requests, the engine's counts and the
    runner's step count exactly where as many ``step()`` calls leave them."""
    spanned, spanned_runner = _decoding_engine(False)
    stepped, stepped_runner = _decoding_engine(False)
    span = spanned.open_decode_span(lambda n, positions: 1e-3, None)
    assert span is not None
    for _ in range(5):
        assert span.still_plain() and span.step() == 1e-3
        stepped.step()
    span.commit()
    for rid in ("a", "b"):
        a, b = spanned.get_request(rid), stepped.get_request(rid)
        assert (a.output_token_ids, a.num_computed_tokens) == (b.output_token_ids, b.num_computed_tokens)
        assert spanned.kv.block_ids(rid) == stepped.kv.block_ids(rid)
    assert spanned.stats() == stepped.stats()
    assert spanned_runner.num_steps == stepped_runner.num_steps
    spanned.check_integrity()


def test_no_span_where_the_runner_checks_contents_or_nothing_runs():
    engine, _ = _decoding_engine(True)
    assert engine.open_decode_span(lambda n, positions: 1e-3, None) is None
    idle = Engine(EngineConfig(model="sim", max_model_len=64, cache=CacheConfig(block_size=4, num_tokens=64)),
                  runner=SimRunner(16, 4, check_contents=False), tokenizer=NullTokenizer())
    assert idle.open_decode_span(lambda n, positions: 1e-3, None) is None
