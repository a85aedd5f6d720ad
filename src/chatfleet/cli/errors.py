"""How every `chatfleet` command fails: one clear line on stderr and exit code 2, never a traceback.

``guard`` wraps each command: a ``ChatfleetError`` prints its message; a file or network error
prints what could not be read or reached; anything else prints its type and message, with the
traceback only when ``CHATFLEET_DEBUG=1`` asks for it. Bad flags are click's own usage errors
(also exit 2). ``check_port`` and ``check_reachable`` let commands fail before slow work.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable
from typing import NoReturn, TypeVar

import click
import httpx
import typer

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


def guard_all(app: typer.Typer) -> None:
    """Wrap every command of ``app`` and of its sub-groups with ``guard``."""
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
