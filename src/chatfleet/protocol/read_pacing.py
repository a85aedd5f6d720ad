"""Large request bodies read at a bounded rate, so that a burst of them cannot hold the GIL.

A hundred 1 MB bodies sent at once arrive at loopback speed; reading them (the server's HTTP
parser and the ASGI layers, a few tens of microseconds per 64 KB chunk) keeps the event loop busy
for a burst of a few hundred milliseconds. The engine's step loop runs on another thread of the
same interpreter and takes the GIL back after every kernel: behind a busy event loop each time
waits for the interpreter's switch interval, and one step stretches over the whole burst.

``ReadPacer.take(n)`` spends ``n`` bytes of a shared budget of ``bytes_per_s``: each chunk of a
large body reserves the next free slot and sleeps until it (the socket's flow control holds the
rest back meanwhile), so large bodies together read at most ``bytes_per_s``, and the event loop
idles between their chunks, which lets the step loop run. Small bodies never wait; a slow client
spends no budget, so it cannot hold others back.

The rate is 16 MB/s per event loop (a gateway's reads and forwards share it). At 64 MB/s a hundred
1 MB bodies still froze a stream relayed by the gateway for 150-340 ms, every one of the largest
gaps in the second or two its intake lasted; at 16 MB/s its largest gap was 1.21x and 2.41x its gap
alone in two runs (48-121 ms), the gaps no longer bunched in the intake
(``benchmarks/hostile_bodies.py``, benchmarks/README.md). A chat turn's body is tens of KB and never
paced; a 1 MB body alone takes ~60 ms more to read, and 16 MB/s of large bodies is millions of
tokens a second, more than any replica prefills.
"""

from __future__ import annotations

import asyncio

LARGE_BODY_BYTES = 256 << 10  # bodies at least this large are paced
LARGE_BODY_BYTES_PER_S = 16 << 20  # all large bodies together, per event loop (measured above)


class ReadPacer:
    """A byte budget per event loop that large bodies' chunks spend in turn."""

    def __init__(self, bytes_per_s: float = LARGE_BODY_BYTES_PER_S) -> None:
        if bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be > 0")
        self.bytes_per_s = bytes_per_s
        self._free_at: dict[asyncio.AbstractEventLoop, float] = {}

    def reserve(self, loop: asyncio.AbstractEventLoop, n: int, now: float) -> float:
        """Reserve ``n`` bytes at time ``now``: the seconds to wait before reading on."""
        start = max(now, self._free_at.get(loop, now))
        self._free_at[loop] = start + n / self.bytes_per_s
        return start - now

    async def take(self, n: int) -> None:
        loop = asyncio.get_running_loop()
        delay = self.reserve(loop, n, loop.time())
        if delay > 0:
            await asyncio.sleep(delay)
