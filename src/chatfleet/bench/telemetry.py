"""Clock telemetry during a run: NVML (SM clock, temperature, power, throttle reasons) when a
GPU is present, CPU frequency otherwise. Runs whose clock fell under a floor are set aside."""

from __future__ import annotations

import asyncio
import glob
import time
from dataclasses import asdict, dataclass, field

from chatfleet.errors import ConfigError


@dataclass(frozen=True)
class ClockSample:
    t_s: float  # seconds since the sampler started
    clock_mhz: float | None  # SM clock (GPU) or mean core frequency (CPU)
    temperature_c: float | None = None
    power_w: float | None = None
    throttle_reasons: tuple[str, ...] = ()


@dataclass
class Telemetry:
    source: str  # 'nvml', 'cpufreq', 'cpuinfo' or 'none'
    max_clock_mhz: float | None
    samples: list[ClockSample] = field(default_factory=list)

    @property
    def min_clock_mhz(self) -> float | None:
        vals = [s.clock_mhz for s in self.samples if s.clock_mhz is not None]
        return min(vals) if vals else None

    @property
    def mean_clock_mhz(self) -> float | None:
        vals = [s.clock_mhz for s in self.samples if s.clock_mhz is not None]
        return sum(vals) / len(vals) if vals else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["min_clock_mhz"], d["mean_clock_mhz"] = self.min_clock_mhz, self.mean_clock_mhz
        return d


def floor_mhz(spec: float | None, max_clock: float | None) -> float | None:
    """Clock floor: a value <= 1 is a fraction of the maximum clock, larger values are MHz."""
    if spec is None:
        return None
    if spec <= 0:
        raise ConfigError(f"clock floor must be positive, got {spec}")
    if spec <= 1:
        return spec * max_clock if max_clock else None
    return spec


def throttled(tel: Telemetry, floor: float | None) -> bool:
    low = tel.min_clock_mhz
    return floor is not None and low is not None and low < floor


class _NVML:
    def __init__(self) -> None:
        import pynvml  # from the nvidia-ml-py package

        pynvml.nvmlInit()
        self.nv = pynvml
        self.h = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.max_clock = float(pynvml.nvmlDeviceGetMaxClockInfo(self.h, pynvml.NVML_CLOCK_SM))
        self.reasons = {v: k.replace("nvmlClocksThrottleReason", "").replace("nvmlClocksEventReason", "")
                        for k, v in vars(pynvml).items()
                        if k.startswith(("nvmlClocksThrottleReason", "nvmlClocksEventReason"))
                        and isinstance(v, int) and v and not k.endswith(("None", "All"))}

    def sample(self, t: float) -> ClockSample:
        nv, h = self.nv, self.h
        mask = nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)
        names = tuple(sorted({n for bit, n in self.reasons.items() if mask & bit and n != "GpuIdle"}))
        return ClockSample(t, float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                           float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                           nv.nvmlDeviceGetPowerUsage(h) / 1000.0, names)


def _cpu_mhz() -> tuple[str, float | None]:
    freqs = []
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_cur_freq"):
        try:
            freqs.append(int(open(path).read()) / 1000.0)
        except (OSError, ValueError):
            pass
    if freqs:
        return "cpufreq", sum(freqs) / len(freqs)
    try:
        vals = [float(line.split(":")[1]) for line in open("/proc/cpuinfo") if line.startswith("cpu MHz")]
    except OSError:
        vals = []
    return ("cpuinfo", sum(vals) / len(vals)) if vals else ("none", None)


def _cpu_max_mhz() -> float | None:
    vals = []
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/cpuinfo_max_freq"):
        try:
            vals.append(int(open(path).read()) / 1000.0)
        except (OSError, ValueError):
            pass
    return max(vals) if vals else None


class TelemetrySampler:
    """Samples clocks every ``interval_s`` on the running event loop until stopped."""

    def __init__(self, interval_s: float = 0.5, use_gpu: bool = True) -> None:
        self.interval_s = interval_s
        self.nvml = None
        if use_gpu:
            try:
                self.nvml = _NVML()
            except Exception:  # no pynvml, no driver or no GPU: fall back to CPU clocks
                self.nvml = None
        if self.nvml is not None:
            self.tel = Telemetry("nvml", self.nvml.max_clock)
        else:
            source, _ = _cpu_mhz()
            self.tel = Telemetry(source, _cpu_max_mhz())
        self._task: asyncio.Task | None = None
        self._t0 = time.perf_counter()

    def sample(self) -> ClockSample:
        t = time.perf_counter() - self._t0
        if self.nvml is not None:
            return self.nvml.sample(t)
        return ClockSample(t, _cpu_mhz()[1])

    async def _loop(self) -> None:
        while True:
            self.tel.samples.append(self.sample())
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> Telemetry:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.tel.samples.append(self.sample())
        return self.tel
