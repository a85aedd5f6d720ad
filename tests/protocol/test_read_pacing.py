"""Large bodies share one read budget per event loop: chunks reserve slots in turn, so together
they read at most the budget's rate; a reader that comes after an idle spell does not wait."""

from __future__ import annotations

import pytest

from chatfleet.protocol.read_pacing import ReadPacer


def test_chunks_reserve_consecutive_slots_of_the_shared_budget():
    pacer = ReadPacer(bytes_per_s=1000)
    loop, other = object(), object()
    waits = [pacer.reserve(loop, 500, now=10.0) for _ in range(3)]  # three readers at once
    assert waits == [0.0, 0.5, 1.0]
    assert pacer.reserve(other, 500, now=10.0) == 0.0  # another event loop has its own budget
    assert pacer.reserve(loop, 100, now=11.2) == pytest.approx(0.3)  # the slot after the last one
    assert pacer.reserve(loop, 100, now=20.0) == 0.0  # after an idle spell: no wait, no credit kept


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="bytes_per_s"):
        ReadPacer(0)
