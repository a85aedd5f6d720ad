"""Cache-reset verification, the knee sweep and the report, against the scripted server."""

import asyncio
import json

import pytest

from chatfleet.bench.client import ClientConfig
from chatfleet.bench.console import undecided_lines
from chatfleet.bench.demo import why_no_knee
from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.report import load_result, render_html, result_document, sweep_to_dict
from chatfleet.bench.server_ops import ResetError, ServerControl, parse_metrics
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.sweep import Bench, RunProtocol, SweepResult, SweepSpec, sweep
from chatfleet.bench.tokens import EstimateCounter
from chatfleet.bench.workload import Workload, get_profile
from chatfleet.errors import ConfigError


def reset(url, **kw):
    async def go():
        c = ServerControl(url, "scripted", **kw)
        try:
            return await c.reset_verified()
        finally:
            await c.close()

    return asyncio.run(go())


def test_working_reset_is_verified_by_usage(scripted):
    check = reset(scripted())
    assert check.method == "usage" and check.cached_before > 0 and check.cached_after == 0


def test_reset_that_does_not_empty_the_cache_is_detected(scripted):
    with pytest.raises(ResetError, match="did not empty the cache"):
        reset(scripted("--broken-reset"))


def test_reset_verified_by_metrics_when_usage_lacks_cached_tokens(scripted):
    url = scripted("--no-cached-usage")
    assert reset(url).method == "metrics"
    with pytest.raises(ResetError, match="vllm:prefix_cache_hits"):
        reset(scripted("--no-cached-usage", "--broken-reset"))


def test_sglang_flush_cache_and_unknown_kind(scripted):
    assert reset(scripted(), kind="sglang").method == "usage"
    with pytest.raises(ConfigError, match="valid: chatfleet, vllm, sglang, none"):
        ServerControl("http://127.0.0.1:1", "m", kind="trt")


def test_parse_metrics_sums_label_sets():
    m = parse_metrics('# HELP x\nvllm:prefix_cache_hits_total{model_name="a"} 3\n'
                      'vllm:prefix_cache_hits_total{model_name="b"} 4.0\nother 1e3\n')
    assert m == {"vllm:prefix_cache_hits_total": 7.0, "other": 1000.0}


def test_sweep_finds_the_knee_of_a_load_dependent_server(scripted):
    # ITL = 2 ms + 4 ms per stream in flight: ITL p50 <= 30 ms breaks past ~7 streams.
    url = scripted("--ttft-ms", "5", "--itl-ms", "2", "--itl-per-stream-ms", "4")
    proto = RunProtocol(url, LoadSpec("concurrency", 1, duration_s=0.8, warmup_s=0.2, drain_timeout_s=10),
                        parse_slo("itl_p50<=30ms"), repeats=1, base_seed=3)
    seeds = []

    def make(seed):
        seeds.append(seed)
        return Workload(get_profile("cpu-roleplay"), seed, EstimateCounter())

    async def go():
        b = Bench(proto, ClientConfig("scripted"), make)
        try:
            return await sweep(b, SweepSpec(start=2, max_level=64, growth=2.0, resolution=1))
        finally:
            await b.close()

    res = asyncio.run(go())
    levels = [p.level for p in res.points]
    assert res.knee_reached and res.knee is not None and 5 <= res.knee <= 9, (res.knee, levels)
    assert res.point(res.knee).passed and not res.point(res.knee + 1).passed  # bisected to resolution 1
    assert len(set(seeds)) == len(seeds)  # a new seed for every run
    assert all(r.reset.method == "usage" for p in res.points for r in p.runs)

    doc = result_document("sweep", {"url": url}, {"scripted": sweep_to_dict(res)})
    text = json.dumps(doc)
    assert '"records"' in text and '"intended_s"' in text  # raw per-request records are kept
    html = render_html(json.loads(text))
    assert html.count("<img") == 4 and f"knee {res.knee:g}" in html


def test_load_result_rejects_foreign_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"a": 1}')
    with pytest.raises(ConfigError, match="not a chatfleet bench result"):
        load_result(p)


def run_point_at(url, slo, level, **kw):
    proto = RunProtocol(url, LoadSpec("concurrency", 1, duration_s=0.4, warmup_s=0.0, drain_timeout_s=10),
                        parse_slo(slo), base_seed=5, confidence=0.95, **kw)

    async def go():
        b = Bench(proto, ClientConfig("scripted"), lambda seed: Workload(get_profile("cpu-roleplay"), seed,
                                                                        EstimateCounter()))
        try:
            return await b.run_point(level)
        finally:
            await b.close()

    return asyncio.run(go())


def test_an_undecided_point_is_extended_up_to_its_bound_and_never_called(scripted):
    # A fast server, but a p99 over a few dozen requests cannot be bounded above (368 are needed).
    url = scripted("--ttft-ms", "2", "--itl-ms", "1")
    point = run_point_at(url, "ttft_p99<=1s", 2, extend_up_to=3)
    assert point.verdict == "undecided" and not point.passed
    assert [r.extension for r in point.runs] == [False, True, True]
    iv = point.judged.intervals["ttft_p99"]
    assert iv.n == sum(r.summary.requests for r in point.runs) < 368 and iv.high == float("inf")
    d = point.to_dict(with_records=False)
    assert d["verdict"] == "undecided" and d["confidence"]["intervals"]["ttft_p99"]["n"] == iv.n
    res = SweepResult("concurrency", "ttft_p99<=1s", [point], None, True)
    assert res.undecided == [2]
    (line,) = undecided_lines(res)  # every request within the target: the bound above is what is missing
    assert line.startswith("load 2 undecided after 3 runs") and "needs >= 368 values" in line
    assert "would decide it at about 368" in line
    why = why_no_knee(res)  # the demo's plain reason for a missing knee
    assert why.startswith("the lowest load measured, 2, stayed undecided after 3 runs: ttft_p99") and "368" in why
    page = render_html(json.loads(json.dumps(result_document("sweep", {}, {"s": sweep_to_dict(res)}))))
    assert "undecided" in page and "368" in page


def test_a_clear_point_decides_at_once(scripted):
    url = scripted("--ttft-ms", "2", "--itl-ms", "1")
    point = run_point_at(url, "itl_p50<=50ms", 2, extend_up_to=3)
    assert point.verdict == "pass" and point.passed and len(point.runs) == 1
    # TTFT, not ITL: the scripted 2 ms before the first token is a floor on any machine, while
    # inter-token gaps may read as 0 where a busy client reads several chunks at once.
    broken = run_point_at(url, "ttft_p50<=0.1ms", 2, extend_up_to=3)
    assert broken.verdict == "fail" and len(broken.runs) == 1
