"""The machine a measurement ran on, in a few words: CPU model, logical CPUs and the load average,
so every demo result says where its numbers come from; and how much of the machine's CPU time
other work took while it measured (``CpuWatch``), so a result says when it was disturbed
(torch-free, read from /proc and os)."""

from __future__ import annotations

import os
import platform
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class MachineInfo:
    cpu_model: str
    logical_cpus: int
    load_average: tuple[float, float, float]  # 1, 5 and 15 minutes

    def describe(self) -> str:
        one, five, fifteen = self.load_average
        return f"{self.cpu_model}, {self.logical_cpus} CPUs, load average {one:.2f} {five:.2f} {fifteen:.2f}"

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo (x86 'model name', Arm 'Model' or 'Hardware');
    else what ``platform`` says; 'unknown CPU' where nothing does."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for key in ("model name", "Model", "Hardware"):
        for line in cpuinfo.splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key and value.strip():
                return " ".join(value.split())
    return platform.processor() or platform.machine() or "unknown CPU"


def load_average() -> tuple[float, float, float]:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        nan = float("nan")
        return nan, nan, nan
    return round(one, 2), round(five, 2), round(fifteen, 2)


def machine_info() -> MachineInfo:
    return MachineInfo(cpu_model(), os.cpu_count() or 1, load_average())


DISTURBED_SHARE = 0.10  # other work at normal priority above this share of the CPU time disturbs a measurement


@dataclass(frozen=True)
class CpuUse:
    """The machine's CPU time over a stretch of wall time, split between this process with its
    descendants (the demo's client and servers) and everything else."""

    seconds: float  # wall time watched
    cpus: int
    ours_s: float  # CPU seconds of this process and its descendants
    others_s: float  # CPU seconds of every other process (and the kernel's interrupts), any priority
    others_nice_s: float  # of which at a positive nice: work that yields to ours, yet takes CPU beside it
    steal_s: float  # CPU seconds the hypervisor gave to other machines

    def _share(self, cpu_s: float) -> float:
        total = self.seconds * self.cpus
        return cpu_s / total if total > 0 else 0.0

    @property
    def others_share(self) -> float:
        """Other work's CPU time (steal included) as a share of all the machine's CPU time."""
        return self._share(self.others_s + self.steal_s)

    @property
    def contending_share(self) -> float:
        """The share other work took at normal priority, competing with ours on equal terms (steal
        included); niced work runs mostly where ours leaves a CPU idle."""
        return self._share(self.others_s - self.others_nice_s + self.steal_s)

    @property
    def disturbed(self) -> bool:
        return self.contending_share > DISTURBED_SHARE

    def describe(self) -> str:
        extra = [f"{self._share(self.others_nice_s):.0%} niced, {self.contending_share:.0%} at normal priority"]
        if self.steal_s >= 0.5:
            extra.append(f"steal {self.steal_s:.0f} s")
        return f"{self.others_share:.0%} of the {self.cpus} CPUs over {self.seconds:.0f} s ({', '.join(extra)})"

    def to_dict(self) -> dict:
        return {**asdict(self), "others_share": self.others_share, "contending_share": self.contending_share,
                "disturbed": self.disturbed}


def cpu_times(stat: str) -> tuple[float, float, float]:
    """(busy, nice, steal) clock ticks of all CPUs from /proc/stat's text."""
    for line in stat.splitlines():
        f = line.split()
        if f and f[0] == "cpu":
            v = [int(x) for x in f[1:9]] + [0] * max(0, 8 - len(f[1:9]))
            user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
            return float(user + nice + system + irq + softirq), float(nice), float(steal)
    return 0.0, 0.0, 0.0


def process_ticks(stat: str) -> tuple[int, int, float, int]:
    """(pid, ppid, utime + stime ticks, nice) from a /proc/<pid>/stat line."""
    head, _, rest = stat.rpartition(")")
    f = rest.split()
    return int(head.split("(", 1)[0]), int(f[1]), float(int(f[11]) + int(f[12])), int(f[16])


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _tree_ticks(root: int) -> dict[int, tuple[float, int]]:
    """pid -> (CPU ticks, nice) of ``root`` and its descendants, from /proc."""
    procs: dict[int, tuple[int, float, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        text = _read(f"/proc/{entry.name}/stat")
        if text is None:
            continue
        try:
            pid, ppid, ticks, nice = process_ticks(text)
        except (ValueError, IndexError):
            continue
        procs[pid] = (ppid, ticks, nice)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in procs and pid not in out:
            out[pid] = procs[pid][1:]
            todo.extend(children.get(pid, ()))
    return out


class CpuWatch:
    """Samples the machine's and this process tree's CPU time (every ``interval_s``, so a child
    that ends between samples loses at most its last interval) until ``stop``."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._first: dict[int, float] = {}
        self._last: dict[int, tuple[float, int]] = {}
        self.available = Path("/proc/stat").exists()
        self._started = False
        self._t0 = time.monotonic()
        self._cpu0 = (0.0, 0.0, 0.0)

    def _sample(self) -> None:
        for pid, (ticks, nice) in _tree_ticks(os.getpid()).items():
            self._first.setdefault(pid, 0.0 if self._started else ticks)
            self._last[pid] = (ticks, nice)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> CpuWatch:
        self._started = False
        self._t0 = time.monotonic()
        self._cpu0 = cpu_times(_read("/proc/stat") or "")
        if self.available:
            self._sample()
            self._started = True
            self._thread.start()
        return self

    def stop(self) -> CpuUse:
        cpus = os.cpu_count() or 1
        if not self.available:
            return CpuUse(time.monotonic() - self._t0, cpus, 0.0, 0.0, 0.0, 0.0)
        self._stop.set()
        self._thread.join()
        self._sample()
        secs = time.monotonic() - self._t0
        busy1, nice1, steal1 = cpu_times(_read("/proc/stat") or "")
        busy0, nice0, steal0 = self._cpu0
        tick = float(os.sysconf("SC_CLK_TCK"))
        ours = sum(t - self._first.get(pid, 0.0) for pid, (t, _) in self._last.items())
        ours_nice = sum(t - self._first.get(pid, 0.0) for pid, (t, n) in self._last.items() if n > 0)
        others = max(0.0, busy1 - busy0 - ours)
        others_nice = min(others, max(0.0, nice1 - nice0 - ours_nice))
        return CpuUse(secs, cpus, ours / tick, others / tick, others_nice / tick,
                      max(0.0, steal1 - steal0) / tick)


def code_version(repo: Path | None = None) -> dict:
    """The commit the measured code is at, and the tracked files changed beside it (None where
    ``repo`` is not a git checkout or git is missing): a demo compares engines only at one commit."""
    repo = repo or Path(__file__).resolve().parents[3]

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout if r.returncode == 0 else None

    head = git("rev-parse", "--short=12", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    changed = None if status is None else sorted(line[3:] for line in status.splitlines() if line.strip())
    return {"commit": head.strip() if head else None, "changed_files": changed}


def describe_code(version: dict) -> str:
    if not version.get("commit"):
        return "code: not a git checkout"
    changed = version.get("changed_files") or []
    return f"code at {version['commit']}" + (f" with {len(changed)} tracked files changed beside it" if changed
                                            else ", no tracked file changed")
