"""A request body assembled from its chunks without holding the interpreter for the copies.

A server's event loop shares the interpreter with other threads (the engine's step loop). Joining
a large body's chunks (``b"".join``) copies it into freshly allocated memory while holding the
GIL: ~0.7 ms per MB on a quiet machine, most of it the page faults of the new memory, and several
times that on a busy one; a hundred 1 MB bodies at once held the step loop back for hundreds of
milliseconds (``benchmarks/hostile_bodies.py``, py-spy: the event loop's time in the joins).

``BodyAssembler`` keeps a small body's chunks in a list and joins them (cheap). Once the body
reaches ``spool_bytes`` (by default the servers' large-body size, ``read_pacing.LARGE_BODY_BYTES``)
it writes each chunk to an anonymous memory file (``os.memfd_create``) and reads the whole body
back with one ``os.pread``: ``os.write`` and ``os.pread`` release the GIL, so the copies and their
page faults run beside the other threads. Where the platform has no memfd, it joins the chunks as
before.

States: collecting in memory -> (spooled to the memory file) -> done (``result``) or discarded
(``discard``); the file is closed in both ends, and ``result`` or ``discard`` may be called once.
"""

from __future__ import annotations

import os

from chatfleet.protocol.read_pacing import LARGE_BODY_BYTES


class BodyAssembler:
    """The chunks of one request body, in arrival order."""

    def __init__(self, spool_bytes: int = LARGE_BODY_BYTES) -> None:
        self._fd: int | None = None  # first: ``__del__`` reads it even where the check below raised
        if spool_bytes < 1:
            raise ValueError("spool_bytes must be >= 1")
        self.spool_bytes = spool_bytes
        self.size = 0
        self._chunks: list[bytes] = []
        self._spooled = False
        self._done = False

    @property
    def spooled(self) -> bool:
        """Whether the body went to the memory file."""
        return self._spooled

    def add(self, chunk: bytes) -> None:
        if self._done:
            raise RuntimeError("the body was already taken or discarded")
        if not chunk:
            return
        self.size += len(chunk)
        if self._fd is None and self.size >= self.spool_bytes and hasattr(os, "memfd_create"):
            self._fd = os.memfd_create("chatfleet-body", os.MFD_CLOEXEC)
            self._spooled = True
            pending, self._chunks = self._chunks, []
            for part in pending:
                self._write(part)
        if self._fd is None:
            self._chunks.append(chunk)
        else:
            self._write(chunk)

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def result(self) -> bytes:
        """The whole body (and the end of this assembler)."""
        if self._done:
            raise RuntimeError("the body was already taken or discarded")
        self._done = True
        if self._fd is None:
            chunks, self._chunks = self._chunks, []
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        try:
            body = os.pread(self._fd, self.size, 0)
            if len(body) != self.size:  # a memory file reads whole; anything else is a bug, said so
                raise OSError(f"read {len(body)} of the body's {self.size} bytes back from its memory file")
            return body
        finally:
            self._close()

    def discard(self) -> None:
        """Drop what was collected (the body is refused)."""
        self._done = True
        self._chunks = []
        self._close()

    def _close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __del__(self) -> None:  # a request cancelled mid-read: the file does not outlive it
        self._close()
