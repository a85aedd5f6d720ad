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
compiled again costs well under a millisecond on those paths. Both variables are read when the
libraries initialise, so they are set here, before ``import torch``; a value already in the
environment wins.

Where the engine's shapes are bounded, a cache this small costs more than it saves: the engine's
linears run on bucketed row counts (``engine/models/row_buckets.py``), ~1,000 primitives in all,
each 2.5-5 ms to build in bf16 on AMX. ``widen_native_cache`` raises a capacity this module set
(never one the user set) before the process builds its first primitive. ``BOUND_MARK`` records
what was set here as ``NAME=VALUE`` pairs, so that processes started with this environment (the
engine core) tell chatfleet's values from the user's.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

CACHE_ENTRIES = 256
ONEDNN_PRIMITIVE_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", ONEDNN_PRIMITIVE_CACHE)
BOUND_MARK = "CHATFLEET_NATIVE_CACHES"


def _marked(environ: MutableMapping[str, str]) -> dict[str, str]:
    pairs = (item.partition("=") for item in environ.get(BOUND_MARK, "").split(",") if "=" in item)
    return {name: value for name, _, value in pairs}


def _mark(environ: MutableMapping[str, str], marked: dict[str, str]) -> None:
    environ[BOUND_MARK] = ",".join(f"{name}={value}" for name, value in sorted(marked.items()))


def bound_native_caches(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set each cache capacity variable to ``CACHE_ENTRIES`` unless it is already set."""
    marked = _marked(environ)
    for name in CACHE_VARIABLES:
        if name not in environ:
            environ[name] = marked[name] = str(CACHE_ENTRIES)
    _mark(environ, marked)


def widen_native_cache(name: str, entries: int, environ: MutableMapping[str, str] = os.environ) -> bool:
    """Raise ``name`` to ``entries`` if its value is the one chatfleet set (not the user's);
    whether it now allows at least ``entries``. Takes effect only before the library reads it."""
    current, marked = environ.get(name), _marked(environ)
    if current is not None and marked.get(name) != current:
        return current.isdigit() and int(current) >= entries
    if current is None or int(current) < entries:
        environ[name] = marked[name] = str(entries)
        _mark(environ, marked)
    return True
