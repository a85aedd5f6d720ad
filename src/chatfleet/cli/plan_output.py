"""What every `chatfleet plan` command shares: its consoles, the --catalog option and the
one-line failure (``error: ...``, exit code 2)."""

from __future__ import annotations

import typer
from rich.console import Console

from chatfleet.errors import ChatfleetError

out = Console()
err = Console(stderr=True)

O_CATALOG = typer.Option(None, "--catalog", help="A YAML GPU catalog extending the packaged one (same layout).")


def fail(e: Exception) -> None:
    msg = e.message if isinstance(e, ChatfleetError) else str(e)
    err.print(f"[red]error:[/] {msg}")
    raise typer.Exit(2)
