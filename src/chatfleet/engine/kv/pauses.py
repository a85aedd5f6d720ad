"""How long conversations pause between turns, learned online (for session-aware eviction).

One ``SessionPauses`` per engine, shared by the device and the host pool's policies: the end of
a session's turn is the last release of its blocks (``note_release``), the start of its next
turn is when the KV manager first allocates for it (``note_turn``); the gap between the two is
one observation.

Model: pauses are lognormal, fitted by the running mean and variance of ``log(gap)`` (a weak
prior, median 30 s and sigma 1, counts as two observations); a turn is followed by another
with probability ``p = (returns + 1) / (turns + 2)`` (a session of k turns contributes k turns
and k - 1 returns). ``reuse_probability`` is the chance that a session silent for ``t``
seconds returns within the next ``horizon`` seconds, given it has not returned yet::

    v(t) = p * (S(t) - S(t + horizon)) / (p * S(t) + 1 - p)

with ``S`` the lognormal survival function; ``k`` sessions sharing a block: ``1 - (1 - v)**k``.
"""

from __future__ import annotations

import math
from collections import OrderedDict

MAX_SESSIONS = 1 << 16  # remembered turn ends (the least recently active forgotten first)


class SessionPauses:
    def __init__(self, prior_median: float = 30.0, prior_sigma: float = 1.0, prior_weight: float = 2.0) -> None:
        self._n = prior_weight
        self._mean = math.log(prior_median)
        self._m2 = prior_sigma**2 * prior_weight
        self.turns = 0
        self.returns = 0
        self._last_end: OrderedDict[str, float] = OrderedDict()

    # ---- observations --------------------------------------------------------------------------
    def note_release(self, session_id: str, when: float) -> None:
        """Blocks of ``session_id`` were released at ``when`` (its turn ended no earlier)."""
        last = self._last_end.get(session_id)
        if last is None or when > last:
            self._last_end[session_id] = when
            self._last_end.move_to_end(session_id)
            if len(self._last_end) > MAX_SESSIONS:
                self._last_end.popitem(last=False)

    def note_turn(self, session_id: str, now: float) -> None:
        """A turn of ``session_id`` starts now."""
        last = self._last_end.get(session_id)
        self.observe_gap(None if last is None else now - last)

    def observe_gap(self, gap: float | None) -> None:
        """A turn started ``gap`` seconds after its session's previous one (None: a new session)."""
        self.turns += 1
        if gap is None:
            return
        self.returns += 1
        x = math.log(max(gap, 1e-3))
        self._n += 1
        delta = x - self._mean
        self._mean += delta / self._n
        self._m2 += delta * (x - self._mean)

    def last_end(self, session_id: str) -> float | None:
        return self._last_end.get(session_id)

    # ---- the model -----------------------------------------------------------------------------
    @property
    def sigma(self) -> float:
        return max(math.sqrt(self._m2 / self._n), 0.05)

    @property
    def median(self) -> float:
        return math.exp(self._mean)

    @property
    def p_continue(self) -> float:
        return (self.returns + 1) / (self.turns + 2)

    def survival(self, t: float) -> float:
        if t <= 0:
            return 1.0
        return 0.5 * math.erfc((math.log(t) - self._mean) / (self.sigma * math.sqrt(2.0)))

    def reuse_probability(self, elapsed: float, horizon: float, sharing: int = 1) -> float:
        p, s = self.p_continue, self.survival(elapsed)
        alive = p * s + (1.0 - p)
        v = p * (s - self.survival(elapsed + horizon)) / alive if alive > 0 else 0.0
        return v if sharing <= 1 else 1.0 - (1.0 - v) ** sharing
