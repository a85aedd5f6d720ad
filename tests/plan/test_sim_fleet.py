"""Fleet and host-tier simulations: the gateway's routing and admission in virtual time."""

from __future__ import annotations

from typer.testing import CliRunner

from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.tokens import EstimateCounter
from chatfleet.bench.workload import Workload, get_profile
from chatfleet.cli.main import app
from chatfleet.engine.config import SchedulerConfig
from chatfleet.gateway.config import GatewayConfig
from chatfleet.plan.catalog import load_catalog
from chatfleet.plan.host_sweep import HostPoint, HostSweep, sweep_host_sizes
from chatfleet.plan.memory_report import read_model_config
from chatfleet.plan.replica_setup import ServingConfig, replica_plan
from chatfleet.plan.sim_bench import sim_protocol
from chatfleet.plan.sim_fleet import FleetBench, naive_fleet_size
from chatfleet.plan.virtual_loop import VirtualClock, run_virtual

PROFILE = get_profile("cpu-roleplay")


def _make(seed: int) -> Workload:
    return Workload(PROFILE, seed, EstimateCounter())


def test_fleet_spreads_sessions_and_sheds_beyond_caps_and_queue():
    cfg, _ = read_model_config("tiny")
    plan = replica_plan(cfg, load_catalog().get("cpu"), ServingConfig(weights="fp32", kv_cache_tokens=4096,
                                                                      scheduler=SchedulerConfig(max_running=4)))
    proto = sim_protocol(LoadSpec("closed", 12, duration_s=15, warmup_s=2), parse_slo("ttft_p99<=5s"))
    clock = VirtualClock()
    bench = FleetBench(proto, _make, plan, clock, 3)
    point = run_virtual(bench.run_point(12.0), clock)
    st = bench.fleet_stats[12.0]
    run = point.runs[0]
    assert all(n > 0 for n in st.requests_per_replica)
    assert sum(st.requests_per_replica) == sum(r.status == "ok" for r in run.records)  # warmup ones too
    assert st.shed == 0 and run.summary.rate_limited == 0
    # a gateway with caps of 1 and no queue sheds: the records say 429 as a real gateway's would
    tight = FleetBench(proto, _make, plan, clock := VirtualClock(), 1,
                       GatewayConfig(max_in_flight=1, queue_size=0, max_queue_wait_s=0.0))
    run2 = run_virtual(tight.run_point(12.0), clock).runs[0]
    assert tight.fleet_stats[12.0].shed > 0
    assert any(r.status == "rate_limited" and r.http_status == 429 for r in run2.records)
    assert naive_fleet_size(2200, 26) == 85 and naive_fleet_size(52, 26) == 2


def test_host_tier_raises_the_returning_turns_hit_rate_until_it_plateaus():
    cfg, _ = read_model_config("tiny")
    serving = ServingConfig(weights="fp32", kv_cache_tokens=1024)
    proto = sim_protocol(LoadSpec("closed", 16, duration_s=20, warmup_s=2), parse_slo("ttft_p99<=5s"))
    res = sweep_host_sizes(proto, 16, _make, cfg, load_catalog().get("cpu"), serving, [0, 2**20, 32 * 2**20])
    rates = [p.hit_rate for p in res.points]
    assert rates[0] < rates[1] <= rates[2] + 0.02, rates
    flat = HostSweep((HostPoint(0, 0.4, True, 0.1), HostPoint(1, 0.7, True, 0.1), HostPoint(2, 0.705, True, 0.1)))
    assert flat.plateau_bytes == 1


def test_cli_plan_fleet_compares_with_the_naive_size():
    res = CliRunner().invoke(app, ["plan", "fleet", "--model", "tiny", "--gpu", "cpu", "--weights", "fp32",
                                   "--kv-cache-tokens", "4096", "--profile", "cpu-roleplay", "--duration", "10",
                                   "--warmup", "1", "--peak", "8", "--knee", "4", "--slo", "ttft_p99<=5s",
                                   "--max-extra", "1"])
    assert res.exit_code == 0, res.output
    assert "peak / chats per replica = 2" in res.output
