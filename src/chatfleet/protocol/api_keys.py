"""Where every chatfleet server reads its Bearer keys from the environment: one variable,
``CHATFLEET_API_KEYS`` (one key, or several comma-separated), for the engine, the gateway and
``serve`` alike. The engine's old singular ``CHATFLEET_API_KEY`` is still read when the new one
is unset, with a one-line warning on stderr naming the new one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping

API_KEYS_ENV = "CHATFLEET_API_KEYS"
OLD_API_KEY_ENV = "CHATFLEET_API_KEY"


def split_keys(values: str | Iterable[str]) -> tuple[str, ...]:
    """Keys from one comma-separated string or several, blanks dropped."""
    parts = [values] if isinstance(values, str) else list(values)
    return tuple(k.strip() for part in parts for k in part.split(",") if k.strip())


def keys_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """``CHATFLEET_API_KEYS``, else the old ``CHATFLEET_API_KEY`` (with a warning), else none."""
    env = os.environ if environ is None else environ
    value = env.get(API_KEYS_ENV)
    if value is None and env.get(OLD_API_KEY_ENV) is not None:
        value = env[OLD_API_KEY_ENV]
        print(f"warning: {OLD_API_KEY_ENV} is read for now; name it {API_KEYS_ENV} (the name every chatfleet "
              "server reads)", file=sys.stderr)
    return split_keys(value) if value else ()
