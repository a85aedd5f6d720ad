"""BodyAssembler: the body comes back byte for byte, whether kept in memory or spooled; the
memory file is closed whichever way the body ends; a spooled body, shared, reads the same in
another process while its assembler is open, and not once it is closed."""

from __future__ import annotations

import multiprocessing
import os
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatfleet.protocol.body_spool import BodyAssembler, SharedBody, body_bytes, finished


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@settings(max_examples=60, deadline=None)
@given(chunks=st.lists(st.binary(max_size=300), max_size=12), spool_bytes=st.integers(1, 800))
def test_result_is_the_chunks_joined(chunks: list[bytes], spool_bytes: int) -> None:
    parts = BodyAssembler(spool_bytes)
    for c in chunks:
        parts.add(c)
    assert parts.size == sum(map(len, chunks))
    several = sum(1 for c in chunks if c) > 1  # one chunk is kept as it is, whatever its size
    assert parts.spooled == (several and parts.size >= spool_bytes and hasattr(os, "memfd_create"))
    assert parts.result() == b"".join(chunks)


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create (Linux)")
def test_large_body_goes_through_a_memory_file_and_closes_it() -> None:
    before = _open_fds()
    parts = BodyAssembler(1 << 16)
    chunk = os.urandom(1 << 16)
    for _ in range(16):
        parts.add(chunk)
    assert parts.spooled
    assert _open_fds() == before + 1
    assert parts.result() == chunk * 16
    assert _open_fds() == before


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create (Linux)")
def test_discard_and_abandon_close_the_file() -> None:
    before = _open_fds()
    parts = BodyAssembler(8)
    parts.add(b"x" * 100)
    parts.discard()
    assert _open_fds() == before
    with pytest.raises(RuntimeError):
        parts.add(b"more")
    abandoned = BodyAssembler(8)
    abandoned.add(b"y" * 100)  # a request cancelled mid-read
    del abandoned
    assert _open_fds() == before


@pytest.mark.parametrize("spool_bytes", [1 << 20, 10])
def test_one_chunk_is_returned_without_a_copy(spool_bytes: int) -> None:
    chunk = b"z" * 1000  # below the threshold, or above it: one chunk needs no join either way
    parts = BodyAssembler(spool_bytes)
    parts.add(chunk)
    parts.add(b"")  # the stream's closing empty chunk
    assert not parts.spooled and parts.shared() is None
    assert parts.result() is chunk


def _read_in_child(shared: SharedBody, out: multiprocessing.Queue[bytes | str]) -> None:
    try:
        out.put(body_bytes(shared))
    except OSError as exc:
        out.put(type(exc).__name__)


def _read_in_another_process(shared: SharedBody) -> bytes | str:
    ctx = multiprocessing.get_context("spawn")  # as the engine's tokenizing workers start
    out: multiprocessing.Queue[bytes | str] = ctx.Queue()
    proc = ctx.Process(target=_read_in_child, args=(shared, out))
    proc.start()
    try:
        return out.get(timeout=60)
    finally:
        proc.join(timeout=60)


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create (Linux)")
def test_a_shared_body_reads_the_same_in_another_process_until_closed() -> None:
    parts = BodyAssembler(1 << 10)
    chunks = [os.urandom(700) for _ in range(5)]
    for c in chunks:
        parts.add(c)
    assert parts.shared() is None  # not finished: the size could still grow
    body = parts.finish()
    shared = parts.shared()
    assert body == b"".join(chunks) and shared is not None and shared.size == len(body)
    assert len(pickle.dumps(shared)) < 200  # what crosses to a worker: a name, not the body
    assert _read_in_another_process(shared) == body
    assert body_bytes(body) is body
    parts.close()
    assert parts.shared() is None
    assert _read_in_another_process(shared) == "FileNotFoundError"
    reused = os.memfd_create("another")  # the closed file's number, most likely, names this one now
    try:
        os.write(reused, b"y" * shared.size)
        assert _read_in_another_process(shared) == "FileNotFoundError"  # never another file's bytes
    finally:
        os.close(reused)


def test_result_once() -> None:
    parts = BodyAssembler()
    parts.add(b"{}")
    assert parts.result() == b"{}"
    with pytest.raises(RuntimeError):
        parts.result()


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create (Linux)")
def test_finished_reads_a_spooled_body_back_off_the_event_loop(monkeypatch) -> None:
    import asyncio
    import threading

    readers: list[str] = []
    real_pread = os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:
        readers.append(threading.current_thread().name)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", pread)
    spooled, small = BodyAssembler(8), BodyAssembler(1 << 20)
    for c in (b"a" * 10, b"b" * 10):
        spooled.add(c)
        small.add(c)

    async def both() -> tuple[bytes, bytes]:
        return await finished(spooled), await finished(small)

    assert asyncio.run(both()) == (b"a" * 10 + b"b" * 10,) * 2
    assert readers and threading.main_thread().name not in readers  # the loop never did the copy
    spooled.close()
