"""chatfleet: serve multi-turn chat LLMs at the most live conversations per GPU inside a latency target."""

from chatfleet.native_caches import bound_native_caches

bound_native_caches()  # before anything imports torch (see native_caches.py)

__version__ = "0.1.0"
