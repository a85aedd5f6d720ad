"""A request body assembled from its chunks without holding the interpreter for the copies.

A server's event loop shares the interpreter with other threads (the engine's step loop). Joining
a large body's chunks (``b"".join``) copies it into freshly allocated memory while holding the
GIL: ~0.7 ms per MB on a quiet machine, most of it the page faults of the new memory, and several
times that on a busy one; a hundred 1 MB bodies at once held the step loop back for hundreds of
milliseconds (``benchmarks/hostile_bodies.py``, py-spy: the event loop's time in the joins).

``BodyAssembler`` keeps a small body's chunks in a list and joins them (cheap); a body that is one
chunk comes back as that chunk, uncopied, whatever its size. Once a body of more than one chunk
reaches ``spool_bytes`` (by default the servers' large-body size, ``read_pacing.LARGE_BODY_BYTES``)
it writes each chunk to an anonymous memory file (``os.memfd_create``) and reads the whole body
back with one ``os.pread``: ``os.write`` and ``os.pread`` release the GIL, so the copies and their
page faults run beside the other threads. Where the platform has no memfd, it joins the chunks as
before.

A spooled body can also be handed to a worker process as a ``SharedBody``: the memory file's path
under ``/proc``, its size and its identity (device, inode), a few bytes to pickle, where the body
itself would be pickled (one more copy with the GIL held, in the executor's feeder thread) and
piped. The worker opens and reads the file itself (``body_bytes``), so that copy happens in its
own interpreter. The file lives as long as the assembler is open: its owner closes it only once
the worker has answered.

States: collecting in memory -> (spooled to the memory file) -> finished (``finish``: the body
read back; a spooled file stays open, ``shared`` names it) -> closed (``close``), or discarded
(``discard``) at any point; ``result`` is ``finish`` then ``close``. The file is closed in every
end, also when an assembler is dropped unclosed (a request cancelled mid-read).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from chatfleet.protocol.read_pacing import LARGE_BODY_BYTES

log = logging.getLogger(__name__)
T = TypeVar("T")


def _pread_whole(fd: int, size: int, where: str) -> bytes:
    body = os.pread(fd, size, 0)
    if len(body) != size:  # a memory file reads whole; anything else is a bug, said so
        raise OSError(f"read {len(body)} of the body's {size} bytes from {where}")
    return body


@dataclass(frozen=True)
class SharedBody:
    """A spooled body that another process of this user can read while its assembler is open."""

    path: str  # /proc/<pid>/fd/<fd> of the owner's memory file
    size: int
    device: int  # the file's identity: once the owner closes it, the fd number can name another
    inode: int

    def read(self) -> bytes:
        """The body; FileNotFoundError once its owner has closed it (whatever the number names now)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a pipe there: no wait
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (self.device, self.inode):
                raise FileNotFoundError(f"the body's memory file {self.path} was closed")
            return _pread_whole(fd, self.size, self.path)
        finally:
            os.close(fd)


def body_bytes(body: bytes | SharedBody) -> bytes:
    """The body's bytes, read from its memory file where it is shared."""
    return body if isinstance(body, bytes) else body.read()


async def offered_by_name(call: Callable[[bytes | SharedBody], Awaitable[T]], body: bytes | SharedBody,
                          fallback: Callable[[], bytes] | None = None) -> T:
    """``call(body)`` (a worker's task); where ``body`` is shared and the worker could not open its
    memory file (a locked-down ``/proc``), ``call`` again with the bytes: ``fallback()``, else read
    here."""
    try:
        return await call(body)
    except OSError as exc:
        if isinstance(body, bytes):
            raise
        log.warning("a worker process could not read a shared body (%s); sending its bytes", exc)
        return await call(fallback() if fallback is not None else body.read())


# The ASGI scope key under which ``BodyLimitMiddleware`` passes the app a spooled body's
# ``SharedBody`` (the body itself is replayed as usual; this lets a route hand it to a worker).
SHARED_BODY_SCOPE_KEY = "chatfleet.shared_body"


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
        if self._fd is None and self._chunks and self.size >= self.spool_bytes and hasattr(os, "memfd_create"):
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

    def finish(self) -> bytes:
        """The whole body; a spooled body's file stays open (``shared``) until ``close``."""
        if self._done:
            raise RuntimeError("the body was already taken or discarded")
        self._done = True
        if self._fd is None:
            chunks, self._chunks = self._chunks, []
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return _pread_whole(self._fd, self.size, "its memory file")

    def shared(self) -> SharedBody | None:
        """The finished, spooled body as a reference for a worker process (None where the body
        was kept in memory, or once closed)."""
        if not self._done or self._fd is None or not os.path.isdir("/proc/self/fd"):
            return None
        st = os.fstat(self._fd)
        return SharedBody(f"/proc/{os.getpid()}/fd/{self._fd}", self.size, st.st_dev, st.st_ino)

    def result(self) -> bytes:
        """The whole body (and the end of this assembler)."""
        try:
            return self.finish()
        finally:
            self.close()

    def discard(self) -> None:
        """Drop what was collected (the body is refused)."""
        self._done = True
        self._chunks = []
        self.close()

    def close(self) -> None:
        """Close the memory file, if any (a ``SharedBody`` of it can no longer be opened)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __del__(self) -> None:  # a request cancelled mid-read: the file does not outlive it
        self.close()


async def finished(parts: BodyAssembler) -> bytes:
    """``parts.finish()`` for an event loop: a spooled body is read back on a thread, since the
    copy into fresh memory and its page faults (~1 ms per MB; a hundred bodies can finish at once)
    would block the loop that also writes every running stream's tokens."""
    return await asyncio.to_thread(parts.finish) if parts.spooled else parts.finish()
