"""Tokenizing in worker processes, with a bound that stops early.

The ``tokenizers`` encoder holds the GIL (measured: a pure-Python thread beside a 1 MB encode
stalls for 1.3 s, ``benchmarks/hostile_bodies.py``), so a tokenizing thread still freezes the
engine's step loop, which shares the interpreter. ``TokenizerProcesses`` encodes texts above
``INLINE_CHARS`` in ``workers`` spawned processes holding the same ``tokenizers`` JSON; the step
loop's process only sends the text and reads the ids back. The same workers run other work on
the tokenizer (``run``: large request bodies are parsed, validated and measured there,
``large_bodies.py``), and run at a lower CPU priority
than the server (``protocol.worker_priority``).

``encode_within(tokenizer, text, max_tokens)`` never tokenizes much more than ``max_tokens``
tokens' worth of a text that cannot fit: a long text is encoded in pieces cut before a space,
counting, and refused as soon as the count passes ``max_tokens`` (with a margin of one token per
cut, as a cut can split what one token would cover); a text that fits is then encoded whole, so
its ids are exactly the tokenizer's.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from typing import Concatenate, ParamSpec, TypeVar

from tokenizers import Tokenizer

from chatfleet.protocol.worker_priority import lower_cpu_priority

P = ParamSpec("P")
T = TypeVar("T")

INLINE_CHARS = 8192  # shorter texts encode in the caller (a few ms): the IPC would cost more
PIECE_CHARS = 1 << 16  # the piece size of the counting pass
_worker_tokenizer: Tokenizer | None = None


class TooManyTokens(int):
    """``encode_within``'s answer for a text that cannot fit: at least this many tokens."""


def _pieces(text: str):
    start = 0
    while start < len(text):
        end = min(len(text), start + PIECE_CHARS)
        if end < len(text):
            cut = text.rfind(" ", start + PIECE_CHARS // 2, end)
            end = cut if cut > start else end
        yield text[start:end]
        start = end


def encode_within(tokenizer: Tokenizer, text: str, max_tokens: int) -> list[int] | TooManyTokens:
    """The ids of ``text``, or TooManyTokens when it has more than ``max_tokens`` (found early)."""
    if len(text) > 4 * PIECE_CHARS and len(text) > 2 * max_tokens:
        count = 0
        for cuts, piece in enumerate(_pieces(text)):
            count += len(tokenizer.encode(piece, add_special_tokens=False).ids)
            if count > max_tokens + cuts:
                return TooManyTokens(count - cuts)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return TooManyTokens(len(ids)) if len(ids) > max_tokens else ids


def _die_with_parent() -> None:
    """End this worker when the server process dies, even by SIGKILL (else an orphan would keep
    the server's stdout open and run on): the kernel's parent-death signal where there is one,
    and a watch on the parent's pid everywhere."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _init(tokenizer_json: str) -> None:
    global _worker_tokenizer
    _die_with_parent()
    lower_cpu_priority()  # a burst of long prompts waits here, not the step loop for a core
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _encode(text: str, max_tokens: int) -> list[int] | int:
    assert _worker_tokenizer is not None, "the worker was not initialized"
    out = encode_within(_worker_tokenizer, text, max_tokens)
    return -int(out) if isinstance(out, TooManyTokens) else out  # a plain int pickles small


def _call(fn: Callable[Concatenate[Tokenizer, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
    assert _worker_tokenizer is not None, "the worker was not initialized"
    return fn(_worker_tokenizer, *args, **kwargs)


class TokenizerProcesses:
    """``encode(text, max_tokens)`` in worker processes (spawned on first use); ``close()`` ends them."""

    def __init__(self, tokenizer: Tokenizer, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.tokenizer = tokenizer
        self.workers = workers
        self._json = tokenizer.to_str()
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init, initargs=(self._json,))
        return self._pool

    def warm(self) -> None:
        """Start the workers now (spawning takes about a second), not on the first long prompt."""
        self._executor().submit(_encode, "", 1)

    async def encode(self, text: str, max_tokens: int) -> list[int] | TooManyTokens:
        if len(text) < INLINE_CHARS:
            return encode_within(self.tokenizer, text, max_tokens)
        loop = asyncio.get_running_loop()
        try:
            out = await loop.run_in_executor(self._executor(), _encode, text, max_tokens)
        except BrokenProcessPool:  # a worker died (killed, out of memory): start afresh next time
            self.close()
            raise
        return TooManyTokens(-out) if isinstance(out, int) else out

    async def run(self, fn: Callable[Concatenate[Tokenizer, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(tokenizer, *args)`` in a worker (``fn`` a module-level function, its arguments and
        result picklable): e.g. ``large_bodies.judge_body``."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor(), partial(_call, fn, *args, **kwargs))
        except BrokenProcessPool:
            self.close()
            raise

    def close(self) -> None:
        """Stop the workers and wait for them (an encode is bounded), so none outlives the server."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            for proc in list(getattr(pool, "_processes", {}).values()):  # a worker may be mid-encode
                proc.terminate()
            pool.shutdown(wait=True, cancel_futures=True)
