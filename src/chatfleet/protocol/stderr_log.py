"""The log handler both servers (engine and gateway) write their console lines through."""

from __future__ import annotations

import logging
import sys
from typing import TextIO


class CurrentStderrHandler(logging.StreamHandler[TextIO]):
    """A stream handler bound to whatever ``sys.stderr`` is when a record is written, not when the
    handler was made: a process that swaps stderr (a test's capture, a daemon's redirect) and
    closes the old one must not leave the handler writing to a closed file."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass
