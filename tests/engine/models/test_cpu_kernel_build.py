"""The CPU kernels' build cache and once-only loader (models/cpu_kernel_build.py), over a tiny C++
source built into a cache under tmp_path."""

import ctypes
import logging
import threading
from pathlib import Path

import pytest

from chatfleet.engine.models.cpu_kernel_build import KernelLoader, build_library, compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler: nothing can be built here")

FLAGS = ("-O2", "-fPIC")
LINK_FLAGS = ("-shared",)


@pytest.fixture
def source(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATFLEET_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CHATFLEET_NO_CPU_KERNEL", raising=False)
    path = tmp_path / "seven.cpp"
    path.write_text('extern "C" int f() { return 7; }\n')
    return path


def _bind_f(calls: list[int]):
    def bind(lib: ctypes.CDLL) -> str | None:
        calls.append(1)
        lib.f.restype = ctypes.c_int
        lib.f.argtypes = []
        return None
    return bind


def _loader(source: Path, bind, needs=lambda: True) -> KernelLoader:
    return KernelLoader(source, FLAGS, LINK_FLAGS, "test kernel", "tests run without it", bind, needs)


def test_the_library_lands_in_the_cache_and_is_reused(source, tmp_path):
    cxx = compiler()
    first = build_library(cxx, source, FLAGS, LINK_FLAGS)
    assert first.parent == tmp_path / "cache" / "kernels" and first.name.startswith("seven-")
    mtime = first.stat().st_mtime_ns
    assert build_library(cxx, source, FLAGS, LINK_FLAGS) == first
    assert first.stat().st_mtime_ns == mtime  # found in the cache, not built again
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]  # no temporaries left


def test_another_source_or_flags_build_another_library(source):
    cxx = compiler()
    first = build_library(cxx, source, FLAGS, LINK_FLAGS)
    assert build_library(cxx, source, ("-O1", "-fPIC"), LINK_FLAGS) != first
    source.write_text('extern "C" int f() { return 8; }\n')
    second = build_library(cxx, source, FLAGS, LINK_FLAGS)
    assert second != first and first.exists() and second.exists()
    lib = ctypes.CDLL(str(second))
    assert lib.f() == 8


def _editing_rebuilds(source: Path, header: Path) -> None:
    """``source`` returns ``kValue`` from ``header``: built, it returns 7; with only the header
    changed to 9, another library is built and returns 9."""
    header.write_text("#pragma once\nconstexpr int kValue = 7;\n")
    cxx = compiler()
    first = build_library(cxx, source, FLAGS, LINK_FLAGS)
    assert ctypes.CDLL(str(first)).f() == 7
    header.write_text("#pragma once\nconstexpr int kValue = 9;\n")
    second = build_library(cxx, source, FLAGS, LINK_FLAGS)
    assert second != first
    assert ctypes.CDLL(str(second)).f() == 9


def test_a_changed_header_of_the_source_builds_another_library(source):
    """A header the source includes with quotes from its folder (as the kernels include
    bf16_bits.h) is part of the cache key: editing only the header rebuilds."""
    source.write_text('#include "value.h"\nextern "C" int f() { return kValue; }\n')
    _editing_rebuilds(source, source.parent / "value.h")


def test_a_changed_header_of_a_header_builds_another_library(source):
    """A header reached through another header (as amx_tiles.h through paged_decode_amx.h) is part
    of the cache key too; a header that includes itself back is read once."""
    (source.parent / "outer.h").write_text('#pragma once\n#include "inner.h"\n#include "outer.h"\n')
    source.write_text('#include "outer.h"\nextern "C" int f() { return kValue; }\n')
    _editing_rebuilds(source, source.parent / "inner.h")


def test_a_failing_build_raises_oserror(source):
    source.write_text("this is not C++\n")
    with pytest.raises(OSError, match="failed"):
        build_library(compiler(), source, FLAGS, LINK_FLAGS)


def test_the_loader_builds_and_binds_once_across_threads(source):
    calls: list[int] = []
    loader = _loader(source, _bind_f(calls))
    results: list[ctypes.CDLL | None] = []
    start = threading.Barrier(8)

    def load() -> None:
        start.wait()
        results.append(loader.load())

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1]
    assert len(results) == 8 and results[0] is not None and all(r is results[0] for r in results)
    assert results[0].f() == 7
    assert loader.available() and loader.load() is results[0] and calls == [1]


def test_the_loader_stays_off_with_chatfleet_no_cpu_kernel(source, monkeypatch, caplog):
    monkeypatch.setenv("CHATFLEET_NO_CPU_KERNEL", "1")
    calls: list[int] = []
    loader = _loader(source, _bind_f(calls))
    with caplog.at_level(logging.INFO, logger="chatfleet.engine.models.cpu_kernel_build"):
        assert loader.load() is None
    assert not loader.available() and calls == []
    assert "test kernel disabled by CHATFLEET_NO_CPU_KERNEL: tests run without it" in caplog.messages
    assert not (source.parent / "cache").exists()  # nothing was built


def test_a_reason_from_bind_turns_the_kernel_off_with_a_warning(source, caplog):
    calls: list[int] = []

    def refuse(lib: ctypes.CDLL) -> str | None:
        calls.append(1)
        return "the CPU refused"

    loader = _loader(source, refuse)
    with caplog.at_level(logging.INFO, logger="chatfleet.engine.models.cpu_kernel_build"):
        assert loader.load() is None
        assert loader.load() is None  # the outcome is kept: bind is not asked again
    assert calls == [1]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == ["test kernel unavailable (the CPU refused): tests run without it"]


def test_a_failing_build_turns_the_kernel_off_with_a_warning(source, caplog):
    source.write_text("this is not C++\n")
    calls: list[int] = []
    loader = _loader(source, _bind_f(calls))
    with caplog.at_level(logging.INFO, logger="chatfleet.engine.models.cpu_kernel_build"):
        assert loader.load() is None
    assert calls == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("test kernel unavailable (")
    assert warnings[0].endswith("): tests run without it")


def test_a_cpu_without_what_the_kernel_needs_gets_none_without_a_warning(source, caplog):
    calls: list[int] = []
    loader = _loader(source, _bind_f(calls), needs=lambda: False)
    with caplog.at_level(logging.INFO, logger="chatfleet.engine.models.cpu_kernel_build"):
        assert loader.load() is None
    assert calls == [] and not [r for r in caplog.records if r.levelno >= logging.INFO]
    assert not (source.parent / "cache").exists()


def test_no_compiler_gets_none_with_an_info_line(source, monkeypatch, caplog):
    from chatfleet.engine.models import cpu_kernel_build

    monkeypatch.setattr(cpu_kernel_build, "compiler", lambda: None)
    loader = _loader(source, _bind_f([]))
    with caplog.at_level(logging.INFO, logger="chatfleet.engine.models.cpu_kernel_build"):
        assert loader.load() is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "test kernel unavailable (no C++ compiler found): tests run without it")]


def test_reset_lets_the_loader_try_again(source, monkeypatch):
    calls: list[int] = []
    loader = _loader(source, _bind_f(calls))
    monkeypatch.setenv("CHATFLEET_NO_CPU_KERNEL", "1")
    assert loader.load() is None
    monkeypatch.delenv("CHATFLEET_NO_CPU_KERNEL")
    assert loader.load() is None  # kept until reset
    loader.reset()
    lib = loader.load()
    assert lib is not None and lib.f() == 7 and calls == [1]
