"""Calibration recovers efficiency factors from a sweep result (here one simulated with known ones)."""

from __future__ import annotations

from dataclasses import replace

from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.report import result_document, sweep_to_dict
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.sweep import SweepResult
from chatfleet.bench.tokens import EstimateCounter
from chatfleet.bench.workload import Workload, get_profile
from chatfleet.plan.calibrate import fit_efficiency, read_measured, score
from chatfleet.plan.catalog import Efficiency, load_catalog
from chatfleet.plan.memory_report import read_model_config
from chatfleet.plan.replica_setup import ServingConfig, replica_plan
from chatfleet.plan.sim_bench import sim_protocol, simulate_levels, simulate_point

PROFILE = get_profile("cpu-roleplay")


def _make(seed: int) -> Workload:
    return Workload(PROFILE, seed, EstimateCounter())


def test_calibration_recovers_the_latencies_of_a_known_device():
    cfg, _ = read_model_config("small")
    cpu = load_catalog().get("cpu")
    serving = ServingConfig(weights="fp32", kv_cache_tokens=4096)
    truth = Efficiency(compute=0.3, memory=0.9, pcie=1.0, step_overhead_ms=4.0)
    proto = sim_protocol(LoadSpec("closed", 1, duration_s=12, warmup_s=2), parse_slo("ttft_p99<=2s"))
    points = [simulate_point(proto, lv, _make, replica_plan(cfg, cpu, serving, efficiency=truth)).points[0]
              for lv in (2.0, 12.0)]
    doc = result_document("sweep", {"profile": {"name": "cpu-roleplay"}, "tokenizer": "estimate(4 bytes/token)",
                                    "protocol": {"load": {"duration_s": 12, "warmup_s": 2}}},
                          {"measured": sweep_to_dict(SweepResult("closed", "ttft_p99<=2s", points, 12.0, False))})
    measured = read_measured(doc)
    assert measured.levels == (2.0, 12.0) and measured.profile == "cpu-roleplay" and measured.tokenizer is None

    def simulate(e: Efficiency):
        return simulate_levels(proto, measured.levels, _make, replica_plan(cfg, cpu, serving, efficiency=e))

    start = replace(cpu.efficiency, compute=1.0, memory=0.25, step_overhead_ms=1.0)
    before = score(measured, simulate(start))
    fit = fit_efficiency(measured, simulate, start)
    assert fit.error < before / 20 and fit.error < 0.01, fit
    # the fitted device predicts the measured latencies within ~15%
    for level in measured.levels:
        for key, want in measured.metrics[level].items():
            assert abs(fit.simulated[level][key] / want - 1) < 0.15, (level, key)


def test_a_sweep_that_joined_chats_mid_conversation_is_refused():
    import pytest

    from chatfleet.errors import ConfigError

    doc = result_document("sweep", {"profile": {"name": "cpu-roleplay"},
                                    "protocol": {"load": {"duration_s": 12, "warmup_s": 2, "join": "steady"}}},
                          {"measured": sweep_to_dict(SweepResult("closed", "ttft_p99<=2s", [], None, False))})
    with pytest.raises(ConfigError, match="join 'start'"):
        read_measured(doc)
