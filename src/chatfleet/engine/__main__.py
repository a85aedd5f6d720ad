"""``python -m chatfleet.engine FLAGS``: one engine process, as the launcher starts it.

The flags are ``engine/argv.py``'s (``engine_argv`` writes them from an ``EngineConfig``); without
``--api-key`` the keys come from ``$CHATFLEET_API_KEYS``, as for ``chatfleet engine``. A bad flag
or config fails with one line and exit code 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace

from chatfleet.engine.api.options import ServerOptions
from chatfleet.engine.argv import parse_engine_argv
from chatfleet.errors import ChatfleetError


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config, server = parse_engine_argv(sys.argv[1:] if argv is None else argv)
        if not server.options.api_keys:
            server = replace(server, options=replace(server.options, api_keys=ServerOptions.keys_from(None)))
        from chatfleet.engine.serve import serve_engine

        serve_engine(config, server)
    except ChatfleetError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
