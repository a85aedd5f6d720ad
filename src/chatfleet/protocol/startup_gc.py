"""Objects alive at a server's start-up kept out of the cyclic garbage collector's full passes.

A full collection walks every tracked object: the engine's process holds ~370k after loading the
model and building the app (torch, pydantic, FastAPI), and one full pass takes ~210 ms of CPU
with the GIL held, so the step loop stops for as long; the gateway's ~80k take ~50 ms, and its
event loop relays no stream meanwhile. Handling requests (a burst of hostile bodies, their
refusals) allocates enough to trigger full passes now and then: ``benchmarks/hostile_bodies.py``
saw stalls of that size. ``freeze_startup_objects`` collects once, then moves everything alive
into the permanent generation (``gc.freeze``): later passes walk only what was made since.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect, then freeze every object alive now; the number frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
