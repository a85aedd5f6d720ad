"""Clock telemetry and the throttle rule: runs under the clock floor are set aside and rerun."""

import asyncio

import pytest

from chatfleet.bench.client import ClientConfig
from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.sweep import Bench, RunProtocol
from chatfleet.bench.telemetry import ClockSample, Telemetry, TelemetrySampler, floor_mhz, throttled
from chatfleet.bench.tokens import EstimateCounter
from chatfleet.bench.workload import Workload, get_profile
from chatfleet.errors import ConfigError


def test_floor_and_throttle_rule():
    tel = Telemetry("nvml", 1980.0, [ClockSample(0, 1980.0), ClockSample(1, 1500.0)])
    assert floor_mhz(0.9, 1980.0) == pytest.approx(1782.0)
    assert floor_mhz(1700, None) == 1700
    assert throttled(tel, 1782.0) and not throttled(tel, 1400.0) and not throttled(tel, None)
    with pytest.raises(ConfigError):
        floor_mhz(-1, 100)


def test_cpu_sampler_without_gpu():
    async def go():
        s = TelemetrySampler(interval_s=0.05, use_gpu=False)
        s.start()
        await asyncio.sleep(0.12)
        return await s.stop()

    tel = asyncio.run(go())
    assert tel.source in ("cpufreq", "cpuinfo", "none") and len(tel.samples) >= 2
    if tel.source != "none":
        assert tel.min_clock_mhz > 0


def test_throttled_runs_are_set_aside_and_rerun(scripted):
    url = scripted("--ttft-ms", "2", "--itl-ms", "1")
    proto = RunProtocol(url, LoadSpec("concurrency", 2, duration_s=0.3, warmup_s=0.0), parse_slo("ttft_p99<=1s"),
                        clock_floor=1e9, throttle_reruns=1, use_gpu_telemetry=False)

    async def go():
        b = Bench(proto, ClientConfig("scripted"), lambda seed: Workload(get_profile("cpu-roleplay"), seed, EstimateCounter()))
        try:
            return await b.run_point(2)
        finally:
            await b.close()

    point = asyncio.run(go())
    if point.runs[0].telemetry.min_clock_mhz is None:
        pytest.skip("this machine reports no CPU clock")
    assert len(point.runs) == 2 and all(r.throttled for r in point.runs)
