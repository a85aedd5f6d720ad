"""BodyAssembler: the body comes back byte for byte, whether kept in memory or spooled; the
memory file is closed whichever way the body ends."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatfleet.protocol.body_spool import BodyAssembler


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@settings(max_examples=60, deadline=None)
@given(chunks=st.lists(st.binary(max_size=300), max_size=12), spool_bytes=st.integers(1, 800))
def test_result_is_the_chunks_joined(chunks: list[bytes], spool_bytes: int) -> None:
    parts = BodyAssembler(spool_bytes)
    for c in chunks:
        parts.add(c)
    assert parts.size == sum(map(len, chunks))
    assert parts.spooled == (parts.size >= spool_bytes and hasattr(os, "memfd_create"))
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


def test_one_chunk_is_returned_without_a_copy() -> None:
    chunk = b"z" * 1000
    parts = BodyAssembler(1 << 20)
    parts.add(chunk)
    parts.add(b"")  # the stream's closing empty chunk
    assert parts.result() is chunk


def test_result_once() -> None:
    parts = BodyAssembler()
    parts.add(b"{}")
    assert parts.result() == b"{}"
    with pytest.raises(RuntimeError):
        parts.result()
