"""The `chatfleet` command: thin typer commands; defaults come from the config dataclasses.

Each command group lives in its own module with a ``register(app)`` function. Every command
fails the same way (``cli/errors.py``): one line on stderr, exit code 2, no traceback.
"""

from __future__ import annotations

import typer

from chatfleet.cli import bench_cmd, demo_cmd, engine_cmd, gate_cmd, gateway_cmd, model_cmd, plan_cmd
from chatfleet.cli.errors import guard_all

app = typer.Typer(
    name="chatfleet",
    help="Serve multi-turn chat LLMs at the most live conversations per GPU, and prove it.",
    no_args_is_help=True,
    add_completion=False,
)

for module in (model_cmd, engine_cmd, bench_cmd, gateway_cmd, demo_cmd, plan_cmd, gate_cmd):
    module.register(app)
guard_all(app)


if __name__ == "__main__":  # pragma: no cover
    app()
