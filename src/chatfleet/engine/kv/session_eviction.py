"""Session-aware eviction: evict the cached block least likely to be reused soon.

Chat traffic is sessions of turns separated by pauses (the user reads and types). A block's
value is the probability that it is reused within a horizon ``H``:

- A conversation's own blocks (one session in their history) are reused when that session
  returns. With ``t`` the time since the session's last turn ended (its blocks' last release),
  ``S`` the survival function of the pause between turns and ``p`` the probability that a turn
  is followed by another at all::

      v(t) = p * (S(t) - S(t + H)) / (p * S(t) + 1 - p)

  i.e. "returns within H" given "has not returned yet". A session that has just finished a
  turn, or has been silent far longer than people pause (probably gone), is worth little; one
  whose pause is about typical is about to return and is worth the most. Plain LRU does the
  opposite of the middle case, which is why it thrashes when many chats cycle through a pool.
- A block shared by several conversations (a persona card, a system prompt) is reused when any
  of them returns: ``1 - (1 - v(t))**k`` with ``k`` the sessions in its reference history and
  ``t`` the time since its last release.
- Blocks without a session id are treated like a one-session block timed by their own release.

The pause model (``pauses.py``: lognormal pauses and a continuation probability ``p``, learned
online from the gaps between a session's turns) is shared by the device and the host pool's
policies. ``H`` is a tenth of the median pause: short, so ``v`` follows the hazard of return
(the chance of a hit soon per unit of memory held, as in hit-density eviction) rather than "ever
again", which a just-finished session would win (with ``H`` = the median, the policy ranked
much like LRU on multi-session replays). Among blocks of equal value the least recently
released goes first; a session's blocks go tail first (released in that order).

Cost: blocks are kept in groups (one per session, one per sharing level, one for blocks without
a session) in release order; a heap orders groups by value, with values refreshed all at once
when the clock has moved by ``refresh_seconds`` (O(groups log groups), at most that often) and
per group when it changes. ``add``/``remove``/``pop`` are O(log groups).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

from chatfleet.engine.kv.block import BlockHint, KVBlock
from chatfleet.engine.kv.pauses import SessionPauses
from chatfleet.errors import KVIntegrityError

_MAX_SHARING = 8  # sharing levels beyond this are one group


class SessionEviction:
    name = "session"
    horizon_fraction = 0.1  # H as a fraction of the median pause (see the module docstring)

    def __init__(self, clock: Callable[[], float] = time.monotonic, pauses: SessionPauses | None = None,
                 refresh_seconds: float = 0.25) -> None:
        self._clock = clock
        self.refresh_seconds = refresh_seconds
        self.model = pauses if pauses is not None else SessionPauses()
        self._groups: dict[Hashable, OrderedDict[int, KVBlock]] = {}
        self._group_of: dict[int, Hashable] = {}  # block id -> group key
        self._time_of: dict[int, float] = {}  # block id -> last release (shared/anonymous groups)
        self._heap: list[tuple[float, int, Hashable]] = []
        self._valid: dict[Hashable, int] = {}  # group key -> sequence number of its live entry
        self._seq = itertools.count()
        self._valued_at = -math.inf

    # ---- values --------------------------------------------------------------------------------
    def _value(self, key: Hashable, now: float) -> float:
        group = self._groups[key]
        if isinstance(key, str):  # one session's own blocks
            last = self.model.last_end(key)
            elapsed = now - (now if last is None else last)
            sharing = 1
        else:  # ("shared", k) or ("anon",): timed by the next victim's release
            assert isinstance(key, tuple)
            elapsed = now - self._time_of[next(iter(group))]
            sharing = key[1] if key[0] == "shared" else 1
        return self.model.reuse_probability(elapsed, self.horizon_fraction * self.model.median, sharing)

    def _push(self, key: Hashable) -> None:
        seq = next(self._seq)
        self._valid[key] = seq
        heapq.heappush(self._heap, (self._value(key, self._valued_at), seq, key))

    def _refresh(self, now: float) -> None:
        self._valued_at = now
        self._valid.clear()
        self._heap = []
        for key in self._groups:
            seq = next(self._seq)
            self._valid[key] = seq
            self._heap.append((self._value(key, now), seq, key))
        heapq.heapify(self._heap)

    # ---- policy interface ----------------------------------------------------------------------
    def add(self, block: KVBlock, hint: BlockHint) -> None:
        if hint.num_sessions > 1:
            key: Hashable = ("shared", min(hint.num_sessions, _MAX_SHARING))
        elif hint.session_id is None:
            key = ("anon",)
        else:
            key = hint.session_id
        moved = False
        if hint.session_id is not None:
            last = self.model.last_end(hint.session_id)
            moved = last is None or hint.last_use > last
            self.model.note_release(hint.session_id, hint.last_use)
        self._time_of[block.block_id] = hint.last_use
        group = self._groups.get(key)
        is_new = group is None
        if group is None:
            group = self._groups[key] = OrderedDict()
        group[block.block_id] = block
        self._group_of[block.block_id] = key
        if is_new or (moved and isinstance(key, str)):
            self._push(key)  # a new group, or a session whose last turn moved

    def add_all(self, blocks: list[KVBlock]) -> None:
        for block in blocks:
            self.add(block, block.hint())

    def remove(self, block: KVBlock) -> None:
        key = self._group_of.pop(block.block_id)
        self._time_of.pop(block.block_id)
        group = self._groups[key]
        was_front = next(iter(group)) == block.block_id
        del group[block.block_id]
        if not group:
            del self._groups[key]
            self._valid.pop(key, None)
        elif was_front and not isinstance(key, str):
            self._push(key)

    def pop(self) -> KVBlock:
        now = self._clock()
        if now - self._valued_at >= self.refresh_seconds or len(self._heap) > 4 * len(self._groups) + 64:
            self._refresh(now)
        while self._heap:
            value, seq, key = heapq.heappop(self._heap)
            if self._valid.get(key) != seq:
                continue
            group = self._groups[key]
            block_id, block = group.popitem(last=False)
            del self._group_of[block_id]
            self._time_of.pop(block_id)
            if not group:
                del self._groups[key]
                del self._valid[key]
            elif isinstance(key, str):
                heapq.heappush(self._heap, (value, seq, key))  # same session, same value
            else:
                self._push(key)
            return block
        raise KVIntegrityError("session eviction: pop from an empty policy")

    def __len__(self) -> int:
        return len(self._group_of)

    def __iter__(self) -> Iterator[KVBlock]:
        for group in self._groups.values():
            yield from group.values()
