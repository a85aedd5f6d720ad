"""The engine's own log on the console, in uvicorn's format and at the server's ``--log-level``
(the API process and the engine core process alike)."""

from __future__ import annotations

import logging

from chatfleet.protocol.stderr_log import CurrentStderrHandler

__all__ = ["console_logging"]


class _UvicornStyle(logging.Formatter):
    """'INFO:     message', as uvicorn prints its own lines."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname + ':':<10}{super().format(record)}"


def console_logging(level: str) -> None:
    """The ``chatfleet`` loggers to stderr at ``level`` (uvicorn's names; 'trace' is debug)."""
    logger = logging.getLogger("chatfleet")
    if not any(getattr(h, "chatfleet_console", False) for h in logger.handlers):
        handler = CurrentStderrHandler()
        handler.setFormatter(_UvicornStyle())
        handler.chatfleet_console = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel("DEBUG" if level == "trace" else level.upper())
