"""What a server holds at start-up is frozen: full collections later walk only newer objects."""

from __future__ import annotations

import gc

from chatfleet.protocol.startup_gc import freeze_startup_objects


def test_objects_alive_at_start_up_are_frozen_and_garbage_is_collected_first():
    class Node:
        def __init__(self) -> None:
            self.me = self

    try:
        kept = [Node() for _ in range(10)]
        garbage = Node()
        del garbage  # a cycle: only the collector frees it
        frozen = freeze_startup_objects()
        # (other threads of the test process may free frozen objects meanwhile: never more frozen)
        assert frozen > 0 and 0 < gc.get_freeze_count() <= frozen
        assert not any(type(o) is Node and o not in kept for o in gc.get_objects())  # collected, not frozen
        assert all(not gc.is_tracked(o) or o not in gc.get_objects() for o in kept)  # frozen: not walked
    finally:
        gc.unfreeze()
