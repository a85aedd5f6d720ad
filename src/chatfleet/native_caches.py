"""Bounds on native kernel caches, applied before PyTorch loads (``chatfleet/__init__.py``).

PyTorch's oneDNN path (the engine's ``onednn`` kernels: prepacked linears and blocked prefill
attention) compiles one kernel per matrix shape and keeps it in two caches: ideep's
(``LRU_CACHE_CAPACITY``) and oneDNN's own primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``),
1,024 entries each by default. Serving chats, shapes hardly repeat: a prefill chunk's attention
products are [rows, context length] and every conversation has its own length, and linears see
every token count a step can have. Each entry holds compiled code and buffers (about 0.3-0.7 MB
for the tiny models' shapes), so an engine's memory grew by hundreds of MB over its first
thousands of requests before the default caps stopped it. ``CACHE_ENTRIES`` keeps the shapes a
running decode batch reuses (a few per batch size) and lets one-off prefill shapes go; a kernel
compiled again costs well under a millisecond. Both variables are read when the libraries
initialise, so they are set here, before ``import torch``; a value already in the environment
wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

CACHE_ENTRIES = 256
CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_native_caches(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set each cache capacity variable to ``CACHE_ENTRIES`` unless it is already set."""
    for name in CACHE_VARIABLES:
        environ.setdefault(name, str(CACHE_ENTRIES))
