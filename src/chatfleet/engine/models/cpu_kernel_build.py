"""How the CPU kernels (``paged_decode_cpu``, ``qk_norm_rope``, ``row_ops``, ``chunk_attention_amx``,
``chunk_attention_avx512``) are built and loaded: each is one C++ file, built with the system's
C++ compiler at first use (``$CXX``, else g++, c++ or clang++), cached by a hash of its source
(with the headers it includes from its folder: ``bf16_bits.h``, ``vec_exp2.h``, ``amx_tiles.h``, shared by several),
the compiler (path and ``--version``), the flags and the CPU (``-march=native`` depends on it) under
``$CHATFLEET_CACHE/kernels`` (default ``~/.cache/chatfleet/kernels``), and loaded with ctypes: no
torch headers, so no extension build.

``KernelLoader`` does that once per process for one kernel: ``CHATFLEET_NO_CPU_KERNEL=1`` keeps
every kernel off, a kernel may need something of the CPU (``needs``, e.g. AMX tiles), and where
there is no compiler, the build or the load fails, or the kernel's ``bind`` (its ctypes signatures,
perhaps an init check) names a reason, ``load()`` gives None and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def _cache_dir() -> Path:
    env = os.environ.get("CHATFLEET_CACHE")
    return (Path(env) if env else Path.home() / ".cache" / "chatfleet") / "kernels"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model name and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def compiler() -> str | None:
    """The C++ compiler the CPU kernels are built with (``$CXX``, else g++, c++ or clang++ on PATH)."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_text(source: Path) -> str:
    """``source`` and, after it, each header it includes with quotes from its own folder (the
    kernels' shared ``bf16_bits.h`` and ``vec_exp2.h``), and the headers those include, each once,
    so that a header's change rebuilds every kernel using it."""
    texts, seen, todo = [], {source.name}, [source]
    while todo:
        text = todo.pop(0).read_text()
        texts.append(text)
        for name in _LOCAL_INCLUDE.findall(text):
            header = source.parent / name
            if name not in seen and header.is_file():
                seen.add(name)
                todo.append(header)
    return "\n".join(texts)


def build_library(cxx: str, source: Path, flags: tuple[str, ...], link_flags: tuple[str, ...]) -> Path:
    """Build ``source`` into a shared library once (cached by a hash of the source and the
    headers it includes, compiler, flags and CPU) and return its path; OSError where the
    compiler fails."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256("\n".join((source_text(source), cxx, version, " ".join(flags + link_flags),
                                       _cpu_signature()))
                            .encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp[: -len(".so")] + ".o"
    try:
        for argv in ([cxx, *flags, "-c", "-o", obj, str(source)], [cxx, *link_flags, "-o", tmp, obj]):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            if proc.returncode:
                raise OSError(f"{cxx} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: concurrent builders agree on the result
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return target


class KernelLoader:
    """One CPU kernel's library, built and loaded at the first ``load()`` (thread-safe), which
    every later call returns (None where it is off or failed: ``what`` names the kernel and
    ``fallback`` what runs instead, in the log line that says why). ``bind`` sets the library's
    ctypes signatures (and may run an init check), returning None, or the reason it cannot be
    used; ``needs`` says whether this machine can run the kernel at all (False: None, no
    warning)."""

    def __init__(self, source: Path, flags: tuple[str, ...], link_flags: tuple[str, ...], what: str,
                 fallback: str, bind: Callable[[ctypes.CDLL], str | None],
                 needs: Callable[[], bool] = lambda: True) -> None:
        self.source = source
        self.flags = flags
        self.link_flags = link_flags
        self.what = what
        self.fallback = fallback
        self._bind = bind
        self._needs = needs
        self._lock = threading.Lock()
        self._tried = False
        self._done = False  # the outcome is final: load() returns it without the lock
        self._lib: ctypes.CDLL | None = None

    def load(self) -> ctypes.CDLL | None:
        """The loaded library, or None where the kernel cannot run here (first call builds it)."""
        if self._done:  # every kernel call of a decode step asks: no lock once the outcome is known
            return self._lib
        with self._lock:
            if not self._tried:
                self._tried = True  # before the work: an exception in it is not retried either
                self._lib = self._build_and_bind()
                self._done = True
            return self._lib

    def available(self) -> bool:
        """Whether the kernel is built and loaded here (builds it on first call)."""
        return self.load() is not None

    def address(self, symbol: str) -> int | None:
        """The address of the library's exported function ``symbol`` (for C++ code that calls it
        directly, ``decode_stack_cpu.cpp``), or None where the kernel is not loaded here."""
        lib = self.load()
        return None if lib is None else ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value

    def reset(self) -> None:
        """Forget the outcome, so that the next ``load()`` tries again (for tests that change
        the environment it reads)."""
        with self._lock:
            self._done = False
            self._tried = False
            self._lib = None

    def _build_and_bind(self) -> ctypes.CDLL | None:
        if os.environ.get("CHATFLEET_NO_CPU_KERNEL"):
            log.info("%s disabled by CHATFLEET_NO_CPU_KERNEL: %s", self.what, self.fallback)
            return None
        if not self._needs():
            log.debug("%s not built: this CPU lacks what it needs: %s", self.what, self.fallback)
            return None
        cxx = compiler()
        if cxx is None:
            log.info("%s unavailable (no C++ compiler found): %s", self.what, self.fallback)
            return None
        try:
            lib = ctypes.CDLL(str(build_library(cxx, self.source, self.flags, self.link_flags)))
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("%s unavailable (%s): %s", self.what, e, self.fallback)
            return None
        reason = self._bind(lib)
        if reason is not None:
            log.warning("%s unavailable (%s): %s", self.what, reason, self.fallback)
            return None
        return lib
