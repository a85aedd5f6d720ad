"""Request limits shared by the engine's and the gateway's HTTP fronts (no web framework here,
so the CLI can read the defaults without importing one)."""

from __future__ import annotations

DEFAULT_MAX_BODY_BYTES = 8 << 20  # a larger request body gets 413
