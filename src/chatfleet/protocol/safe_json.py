"""Parse JSON request bodies so that no client input can reach a handler as a 500.

``parse_json_body(bytes)`` refuses, with a 400 naming the problem and where it is: bytes that are
not UTF-8, NaN and Infinity (not JSON), numbers over ``MAX_NUMBER_DIGITS`` digits, nesting deeper
than ``MAX_DEPTH``, and strings holding lone surrogates (``"\\ud800"`` is valid JSON but no text:
it cannot be encoded, tokenized, hashed or forwarded). ``SafeJSONRoute`` runs it before FastAPI
reads the body (large bodies parse on a worker thread, off the event loop); a body whose content
type is not JSON is refused with a 400 naming it (``check_json_content_type``).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from chatfleet.errors import InvalidRequestError

MAX_DEPTH = 64
MAX_NUMBER_DIGITS = 400
OFF_LOOP_BYTES = 256 << 10  # bodies at least this large parse on a worker thread, one at a time
_large_parses: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}


def _one_large_parse() -> asyncio.Semaphore:
    """One large body parses at a time per loop: ``json.loads`` holds the GIL, and a hundred
    parsing threads at once would leave every other thread of the process (the engine's step
    loop) one turn in a hundred."""
    loop = asyncio.get_running_loop()
    sem = _large_parses.get(loop)
    if sem is None:
        sem = _large_parses[loop] = asyncio.Semaphore(1)
    return sem


def _parse_int(text: str) -> int:
    if len(text) > MAX_NUMBER_DIGITS:
        raise InvalidRequestError(
            f"a number in the body has {len(text)} digits; at most {MAX_NUMBER_DIGITS} are allowed")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > MAX_NUMBER_DIGITS:
        raise InvalidRequestError(
            f"a number in the body has {len(text)} characters; at most {MAX_NUMBER_DIGITS} are allowed")
    value = float(text)
    if not math.isfinite(value):
        raise InvalidRequestError(f"the number {text[:40]} is out of range")
    return value


def _refuse_constant(name: str) -> float:
    raise InvalidRequestError(f"{name} is not valid JSON; send a finite number")


def _where(path: tuple[str | int, ...]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or "the body"


def _bad_text(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_value(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse nesting deeper than ``max_depth`` and strings that are not valid Unicode."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        v, path = stack.pop()
        if len(path) > max_depth:
            raise InvalidRequestError(f"the body is nested more than {max_depth} levels deep")
        if isinstance(v, str):
            if _bad_text(v):
                raise InvalidRequestError(
                    f"{_where(path)}: the text holds an invalid Unicode code point (a lone surrogate"
                    " such as \\ud800); send valid UTF-8 text", param=str(path[0]) if path else None)
        elif isinstance(v, dict):
            for k, item in v.items():
                if _bad_text(k):
                    raise InvalidRequestError(f"{_where(path)}: a key holds an invalid Unicode code point")
                if isinstance(item, (str, dict, list)):
                    stack.append((item, (*path, k)))
        elif isinstance(v, list):
            for i, item in enumerate(v):
                if isinstance(item, (str, dict, list)):
                    stack.append((item, (*path, i)))


def parse_json_body(body: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of ``body``; any client mistake is an ``InvalidRequestError`` (400)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"the body is not valid UTF-8 (byte 0x{body[exc.start]:02x} at offset {exc.start})"
        ) from None
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float,
                           parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"malformed JSON body: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise InvalidRequestError(f"the body is nested more than {max_depth} levels deep") from None
    check_value(value, max_depth)
    return value


def is_json_content_type(header: str | None) -> bool:
    """A request without a content type, or with a JSON one, carries JSON."""
    ctype = (header or "application/json").split(";")[0].strip().lower()
    return ctype == "application/json" or ctype.endswith("+json")


def check_json_content_type(header: str | None) -> None:
    """Refuse a body sent as something other than JSON, naming its content type (engine and
    gateway alike)."""
    if not is_json_content_type(header):
        raise InvalidRequestError(
            f"the body's content type is {(header or '')[:80]!r}; send the request as application/json")


class SafeJSONRoute(APIRoute):
    """An APIRoute whose JSON body goes through ``parse_json_body`` before FastAPI validates it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def safe_handler(request: Request) -> Response:
            if request.method in ("POST", "PUT", "PATCH"):
                body = await request.body()
                if body:
                    check_json_content_type(request.headers.get("content-type"))
                    if len(body) >= OFF_LOOP_BYTES:
                        async with _one_large_parse():
                            value = await asyncio.to_thread(parse_json_body, body)
                    else:
                        value = parse_json_body(body)
                    request._json = value  # Starlette's cache: FastAPI's request.json() returns it
            return await handler(request)

        return safe_handler
