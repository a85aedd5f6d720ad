"""Clock telemetry during a run: NVML when a GPU is present, CPU frequency otherwise. Runs
whose clock fell under a floor are set aside (and measured again, ``sweep.Bench.run_point``).

NVML comes from the ``nvidia-ml-py`` package (``pip install 'chatfleet[gpu]'``; its module is
``pynvml``). Each sample holds the SM clock, the memory clock, the temperature, the board power
and the active clock-event (throttle) reasons, idle excepted. A query the device does not
support (power on some boards) reads None instead of failing the run. On a GPU the floor is
``DEFAULT_GPU_FLOOR`` of the maximum SM clock unless one is given (``run_floor``): a run whose
clock sagged under it measured a slower card than the one being sized."""

from __future__ import annotations

import asyncio
import glob
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

from chatfleet.errors import ConfigError


@dataclass(frozen=True)
class ClockSample:
    t_s: float  # seconds since the sampler started
    clock_mhz: float | None  # SM clock (GPU) or mean core frequency (CPU)
    temperature_c: float | None = None
    power_w: float | None = None
    throttle_reasons: tuple[str, ...] = ()
    mem_clock_mhz: float | None = None  # GPU memory clock (NVML only)


@dataclass
class Telemetry:
    source: str  # 'nvml', 'cpufreq', 'cpuinfo' or 'none'
    max_clock_mhz: float | None
    samples: list[ClockSample] = field(default_factory=list)
    device: str | None = None  # the GPU's name (NVML only)

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


DEFAULT_GPU_FLOOR = 0.8  # of the maximum SM clock: below it a GPU was throttled (power, heat)


def run_floor(spec: float | None, tel: Telemetry) -> float | None:
    """The floor a run is judged by: ``spec`` as ``floor_mhz`` reads it, or on a GPU without one
    ``DEFAULT_GPU_FLOOR`` of its maximum SM clock (CPU runs have no default floor)."""
    if spec is None and tel.source == "nvml":
        spec = DEFAULT_GPU_FLOOR
    return floor_mhz(spec, tel.max_clock_mhz)


def throttled(tel: Telemetry, floor: float | None) -> bool:
    low = tel.min_clock_mhz
    return floor is not None and low is not None and low < floor


_REASON_PREFIXES = ("nvmlClocksEventReason", "nvmlClocksThrottleReason")
_NOT_REASONS = ("None", "All", "GpuIdle")


def clock_event_names(nv: ModuleType) -> dict[int, str]:
    """NVML's clock-event (throttle) reason bits and their names, from the module's constants
    (``nvmlClocksEventReason*``, or the older ``nvmlClocksThrottleReason*``; aliases of one bit
    keep the first name in sorted order)."""
    names: dict[int, str] = {}
    for key in sorted(vars(nv)):
        value = getattr(nv, key)
        for prefix in _REASON_PREFIXES:
            if key.startswith(prefix) and isinstance(value, int) and value and value & (value - 1) == 0:
                name = key[len(prefix):]
                if name not in _NOT_REASONS:
                    names.setdefault(value, name)
    return names


class NVMLReader:
    """One GPU's clocks through NVML (``index``: NVML's device index)."""

    def __init__(self, index: int = 0) -> None:
        import pynvml  # from the nvidia-ml-py package (the [gpu] extra)

        pynvml.nvmlInit()
        self.nv = pynvml
        self.h = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.max_clock = float(pynvml.nvmlDeviceGetMaxClockInfo(self.h, pynvml.NVML_CLOCK_SM))
        name = self._query(pynvml.nvmlDeviceGetName, self.h)
        self.device = name.decode() if isinstance(name, bytes) else name
        self.reasons = clock_event_names(pynvml)
        self._reasons_fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)

    def _query(self, fn: Callable[..., Any] | None, *args: object) -> Any:
        if fn is None:
            return None
        try:
            return fn(*args)
        except self.nv.NVMLError:  # not supported on this board, or a transient failure
            return None

    def sample(self, t: float) -> ClockSample:
        nv, h = self.nv, self.h
        mask = self._query(self._reasons_fn, h) or 0
        names = tuple(sorted(n for bit, n in self.reasons.items() if mask & bit))
        sm = self._query(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
        mem = self._query(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
        temp = self._query(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
        power_mw = self._query(nv.nvmlDeviceGetPowerUsage, h)
        return ClockSample(t, None if sm is None else float(sm), None if temp is None else float(temp),
                           None if power_mw is None else power_mw / 1000.0, names,
                           None if mem is None else float(mem))

    def close(self) -> None:
        self._query(self.nv.nvmlShutdown)


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

    def __init__(self, interval_s: float = 0.5, use_gpu: bool = True, gpu_index: int = 0) -> None:
        self.interval_s = interval_s
        self.nvml: NVMLReader | None = None
        if use_gpu:
            try:
                self.nvml = NVMLReader(gpu_index)
            except Exception:  # no pynvml, no driver or no GPU: fall back to CPU clocks
                self.nvml = None
        if self.nvml is not None:
            self.tel = Telemetry("nvml", self.nvml.max_clock, device=self.nvml.device)
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
        if self.nvml is not None:
            self.nvml.close()
            self.nvml = None
        return self.tel
