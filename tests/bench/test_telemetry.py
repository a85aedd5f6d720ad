"""Clock telemetry and the throttle rule: runs under the clock floor are set aside and rerun."""

import asyncio
import sys
import types

import pytest

from chatfleet.bench.client import ClientConfig
from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.sweep import Bench, RunProtocol
from chatfleet.bench.telemetry import (
    DEFAULT_GPU_FLOOR,
    ClockSample,
    Telemetry,
    TelemetrySampler,
    floor_mhz,
    run_floor,
    throttled,
)
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
        b = Bench(proto, ClientConfig("scripted"),
                  lambda seed: Workload(get_profile("cpu-roleplay"), seed, EstimateCounter()))
        try:
            return await b.run_point(2)
        finally:
            await b.close()

    point = asyncio.run(go())
    if point.runs[0].telemetry.min_clock_mhz is None:
        pytest.skip("this machine reports no CPU clock")
    assert len(point.runs) == 2 and all(r.throttled for r in point.runs)


class FakeNVMLError(Exception):
    pass


def fake_pynvml(power_supported: bool = True, new_api: bool = True):
    """A stand-in for nvidia-ml-py's ``pynvml``: one GPU whose SM clock sags 1980 -> 1400 MHz
    under a power cap, with a HW thermal slowdown on the last sample."""
    nv = types.ModuleType("pynvml")
    state = {"calls": 0, "init": 0, "shutdown": 0}
    sm_clocks = iter([1980, 1700, 1400, 1400, 1400])
    nv.NVMLError = FakeNVMLError
    nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM, nv.NVML_TEMPERATURE_GPU = 0, 2, 0
    prefix = "nvmlClocksEventReason" if new_api else "nvmlClocksThrottleReason"
    for name, bit in (("GpuIdle", 0x1), ("ApplicationsClocksSetting", 0x2), ("SwPowerCap", 0x4),
                      ("HwSlowdown", 0x8), ("HwThermalSlowdown", 0x40), ("None", 0), ("All", 0xFF)):
        setattr(nv, prefix + name, bit)
    nv.nvmlInit = lambda: state.__setitem__("init", state["init"] + 1)
    nv.nvmlShutdown = lambda: state.__setitem__("shutdown", state["shutdown"] + 1)
    nv.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    nv.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    nv.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980 if kind == nv.NVML_CLOCK_SM else 3201

    def clock(h, kind):
        return next(sm_clocks) if kind == nv.NVML_CLOCK_SM else 3201

    def reasons(h):
        state["calls"] += 1
        return 0x1 | 0x4 | (0x40 if state["calls"] >= 3 else 0)

    def power(h):
        if not power_supported:
            raise FakeNVMLError("not supported")
        return 612_500  # milliwatts

    nv.nvmlDeviceGetClockInfo = clock
    nv.nvmlDeviceGetTemperature = lambda h, sensor: 71
    nv.nvmlDeviceGetPowerUsage = power
    setattr(nv, "nvmlDeviceGetCurrentClocksEventReasons" if new_api else "nvmlDeviceGetCurrentClocksThrottleReasons",
            reasons)
    return nv, state


@pytest.mark.parametrize("new_api", [True, False])
def test_nvml_sampler_reads_every_field(monkeypatch, new_api):
    nv, state = fake_pynvml(new_api=new_api)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    s = TelemetrySampler(use_gpu=True)
    assert s.tel.source == "nvml" and s.tel.max_clock_mhz == 1980.0 and s.tel.device == "NVIDIA H200"
    first = s.sample()
    assert (first.clock_mhz, first.mem_clock_mhz) == (1980.0, 3201.0)
    assert (first.temperature_c, first.power_w) == (71.0, 612.5)
    assert first.throttle_reasons == ("SwPowerCap",)  # idle is not a throttle
    s.sample()
    tel = asyncio.run(s.stop())
    assert tel.samples[-1].throttle_reasons == ("HwThermalSlowdown", "SwPowerCap")
    assert tel.min_clock_mhz == 1400.0 and state["init"] == 1 and state["shutdown"] == 1
    assert tel.to_dict()["samples"][0]["mem_clock_mhz"] == 3201.0


def test_nvml_unsupported_query_reads_none(monkeypatch):
    nv, _ = fake_pynvml(power_supported=False)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    sample = TelemetrySampler(use_gpu=True).sample()
    assert sample.power_w is None and sample.clock_mhz == 1980.0


def test_no_pynvml_falls_back_to_cpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert TelemetrySampler(use_gpu=True).tel.source in ("cpufreq", "cpuinfo", "none")


def test_gpu_runs_have_a_default_floor_cpu_runs_do_not():
    gpu = Telemetry("nvml", 1980.0, [ClockSample(0, 1980.0), ClockSample(1, 1500.0)])
    cpu = Telemetry("cpufreq", 3000.0, [ClockSample(0, 1000.0)])
    assert run_floor(None, gpu) == pytest.approx(1980.0 * DEFAULT_GPU_FLOOR)
    assert throttled(gpu, run_floor(None, gpu))  # 1500 < 1584
    assert run_floor(None, cpu) is None and not throttled(cpu, run_floor(None, cpu))
    assert run_floor(1400, gpu) == 1400 and not throttled(gpu, run_floor(1400, gpu))
