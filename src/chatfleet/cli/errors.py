"""How every `chatfleet` command fails: one clear line on stderr and exit code 2, never a traceback.

``guard`` wraps each command: a ``ChatfleetError`` prints its message; a file or network error
prints what could not be read or reached; anything else prints its type and message, with the
traceback only when ``CHATFLEET_DEBUG=1`` asks for it. Click's usage errors (an unknown flag, a
value of the wrong type, a missing option) are one line too, exit 2, naming the command and
suggesting a flag only when it is close to what was typed (``OneLineErrors``, installed on the
app by ``guard_all``). ``check_port`` and ``check_reachable`` let commands fail before slow work.
"""

from __future__ import annotations

import difflib
import functools
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

import click
import httpx
import typer
from typer.core import TyperGroup

try:  # typer vendors click from 0.2x on: its usage errors are its own classes
    from typer._click import exceptions as usage
except ImportError:  # pragma: no cover - an older typer on the real click
    from click import exceptions as usage  # type: ignore[no-redef]

from chatfleet.errors import ChatfleetError, ConfigError

F = TypeVar("F", bound=Callable[..., object])


def fail(message: str) -> NoReturn:
    typer.echo(f"error: {' '.join(message.split())}", err=True)  # one line, whatever the message
    raise typer.Exit(2)


def guard(command: F) -> F:
    """``command`` with every error turned into one line and exit code 2."""

    @functools.wraps(command)
    def run(*args: object, **kwargs: object) -> object:
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort, click.exceptions.Exit, click.exceptions.Abort, click.ClickException,
                KeyboardInterrupt, SystemExit):
            raise
        except ChatfleetError as err:
            fail(err.message)
        except OSError as err:  # a file that is missing or unreadable, a port, a connection
            fail(f"{err.strerror or err}" + (f": {err.filename}" if err.filename else ""))
        except Exception as err:  # noqa: BLE001 - a bug: still one line, traceback on request
            if os.environ.get("CHATFLEET_DEBUG") == "1":
                raise
            fail(f"unexpected {type(err).__name__}: {err} (set CHATFLEET_DEBUG=1 for the traceback)")

    return run  # type: ignore[return-value]


CLOSE_ENOUGH = 0.75  # difflib ratio above which a flag is suggested for a mistyped one


def usage_line(err: usage.UsageError) -> str:
    """One line for a usage error: the command, what was wrong, a close flag if there is one."""
    path = err.ctx.command_path if err.ctx is not None else "chatfleet"
    if isinstance(err, usage.NoSuchOption):
        close = difflib.get_close_matches(err.option_name, sorted(err.possibilities or ()), 1, CLOSE_ENOUGH)
        what = f"no such option {err.option_name}" + (f"; did you mean {close[0]}?" if close else "")
    else:
        what = err.format_message().rstrip(".")
    return f"error: {path}: {' '.join(what.split())} (see '{path} --help')"


class OneLineErrors(TyperGroup):
    """The top-level group: click's usage errors end in one ``error:`` line and exit 2."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: object) -> object:
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False,
                              windows_expand_args=windows_expand_args, **extra)
        except usage.NoArgsIsHelpError as err:  # bare `chatfleet`: its help, as before
            click.echo(err.format_message())
            rv = 0
        except usage.UsageError as err:
            if not standalone_mode:
                raise
            click.echo(usage_line(err), err=True)
            sys.exit(err.exit_code)
        except usage.ClickException as err:
            if not standalone_mode:
                raise
            click.echo(f"error: {' '.join(err.format_message().split())}", err=True)
            sys.exit(err.exit_code)
        except typer.Abort:
            if not standalone_mode:
                raise
            click.echo("aborted", err=True)
            sys.exit(1)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


def guard_all(app: typer.Typer) -> None:
    """Wrap every command of ``app`` and of its sub-groups with ``guard``; the app's usage errors
    become one line (``OneLineErrors``)."""
    if app.info.cls in (None, TyperGroup) or isinstance(app.info.cls, typer.models.DefaultPlaceholder):
        app.info.cls = OneLineErrors
    for info in app.registered_commands:
        if info.callback is not None and not getattr(info.callback, "__wrapped__", None):
            info.callback = guard(info.callback)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            guard_all(group.typer_instance)


def check_port(host: str, port: int) -> None:
    """Fail now, before slow start-up work, if nothing could listen on HOST:PORT."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); "
                              "choose another --port or --host") from None


def check_reachable(url: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> None:
    """Fail with one line if nothing answers HTTP at ``url`` (any status counts as an answer)."""
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False) as client:
            client.get(url.rstrip("/") + "/v1/models", headers=headers or {})
    except httpx.InvalidURL as exc:
        raise ConfigError(f"{url!r} is not a usable URL: {exc}") from None
    except httpx.HTTPError as exc:
        reason = str(exc) or type(exc).__name__
        raise ConfigError(f"cannot reach {url}: {reason}; is the server running?") from None
