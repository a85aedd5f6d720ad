"""`chatfleet` commands of this group (filled in by its owner)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this group's commands to `app`."""
