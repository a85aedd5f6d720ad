"""Parse JSON request bodies so that no client input can reach a handler as a 500.

``parse_json_body(bytes)`` refuses, with a 400 naming the problem and where it is: bytes that are
not UTF-8, NaN and Infinity (not JSON), numbers over ``MAX_NUMBER_DIGITS`` digits, nesting deeper
than ``MAX_DEPTH``, and strings holding lone surrogates (``"\\ud800"`` is valid JSON but no text:
it cannot be encoded, tokenized, hashed or forwarded). Each message names the field (the body's
top-level key) and the rule, e.g. "temperature: NaN is not a JSON number; send a finite number".
``SafeJSONRoute`` runs it before FastAPI
reads the body (large bodies parse on a worker thread, off the event loop); a body whose content
type is not JSON is refused with a 400 naming it (``check_json_content_type``).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from chatfleet.errors import InvalidRequestError
from chatfleet.protocol.body_spool import SHARED_BODY_SCOPE_KEY, BodyAssembler, SharedBody

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


class _Refused:
    """A number the parse keeps as a marker (too many digits, not finite), so that the walk that
    follows can name the field holding it."""

    __slots__ = ("rule",)

    def __init__(self, rule: str) -> None:
        self.rule = rule


def _parse_int(text: str) -> int | _Refused:
    if len(text) > MAX_NUMBER_DIGITS:
        return _Refused(f"the number has {len(text)} digits; a number may have at most {MAX_NUMBER_DIGITS}")
    return int(text)


def _parse_float(text: str) -> float | _Refused:
    if len(text) > MAX_NUMBER_DIGITS:
        return _Refused(f"the number has {len(text)} characters; a number may have at most {MAX_NUMBER_DIGITS}")
    value = float(text)
    if not math.isfinite(value):
        return _Refused(f"the number {text[:40]} is too large; send a finite number")
    return value


def _refuse_constant(name: str) -> _Refused:
    return _Refused(f"{name} is not a JSON number; send a finite number")


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


def _deeper_than(max_depth: int, path: tuple[str | int, ...]) -> InvalidRequestError:
    field = str(path[0]) if path else None
    return InvalidRequestError(
        f"{field or 'the body'}: the JSON is nested more than {max_depth} levels deep;"
        f" at most {max_depth} levels are allowed", param=field)


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"(\s*:)?|[\[{]|[\]}]')


def _deep_field(text: str, max_depth: int) -> str | None:
    """The top-level key under which ``text`` nests deeper than ``max_depth`` (the parser ran out
    of stack before the walk could say where): a scan of keys and brackets only."""
    depth, key = 0, None
    for m in _TOKEN.finditer(text):
        token = m.group()
        if token in "[{":
            depth += 1
            if depth > max_depth:
                return key
        elif token in "]}":
            depth -= 1
        elif depth == 1 and m.group(1):
            key = token[1:token.rindex('"')]
    return key


_WALKED = (str, dict, list, _Refused)


def check_value(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse nesting deeper than ``max_depth``, strings that are not valid Unicode and the numbers
    the parse kept as markers, naming the field (the body's top-level key) that holds them."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        v, path = stack.pop()
        if len(path) > max_depth:
            raise _deeper_than(max_depth, path)
        if isinstance(v, _Refused):
            raise InvalidRequestError(f"{_where(path)}: {v.rule}", param=str(path[0]) if path else None)
        if isinstance(v, str):
            if _bad_text(v):
                raise InvalidRequestError(
                    f"{_where(path)}: the text holds an invalid Unicode code point (a lone surrogate"
                    " such as \\ud800); send valid UTF-8 text", param=str(path[0]) if path else None)
        elif isinstance(v, dict):
            for k, item in v.items():
                if _bad_text(k):
                    raise InvalidRequestError(f"{_where(path)}: a key holds an invalid Unicode code point")
                if isinstance(item, _WALKED):
                    stack.append((item, (*path, k)))
        elif isinstance(v, list):
            for i, item in enumerate(v):
                if isinstance(item, _WALKED):
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
        field = _deep_field(text, max_depth)
        raise _deeper_than(max_depth, (field,) if field is not None else ()) from None
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


# ``app.state.<this>``: an async (path, body) -> JSON value that a server sets to parse large
# bodies its own way (the engine: in its tokenizing process, which refuses there what cannot fit).
# The body comes as a ``SharedBody`` where ``BodyLimitMiddleware`` spooled it (no pickled copy).
LARGE_BODY_PARSER = "large_body_parser"
LargeBodyParser = Callable[[str, bytes | SharedBody], Awaitable[object]]


async def whole_body(request: Request) -> bytes:
    """The request's body, cached where Starlette's ``Request.body`` caches it. Unlike that, a body
    that arrives as one chunk (as ``BodyLimitMiddleware`` replays it) is kept as it is, not copied
    by a join with the stream's closing empty chunk (a copy of a large body holds the GIL)."""
    cached = getattr(request, "_body", None)
    if isinstance(cached, bytes):
        return cached
    parts = BodyAssembler()
    async for chunk in request.stream():
        parts.add(chunk)
    body = parts.result()
    request._body = body
    return body


class SafeJSONRoute(APIRoute):
    """An APIRoute whose JSON body goes through ``parse_json_body`` before FastAPI validates it
    (large ones through the app's ``LARGE_BODY_PARSER`` where it sets one)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        # The content type is judged here (``check_json_content_type``: none means JSON), not by
        # FastAPI's strict check, which would answer a body without one as "not an object".
        self.strict_content_type = False
        handler = super().get_route_handler()

        async def safe_handler(request: Request) -> Response:
            if request.method in ("POST", "PUT", "PATCH"):
                body = await whole_body(request)
                if body:
                    check_json_content_type(request.headers.get("content-type"))
                    judge = getattr(request.app.state, LARGE_BODY_PARSER, None)
                    if len(body) >= OFF_LOOP_BYTES and judge is not None:
                        shared = request.scope.get(SHARED_BODY_SCOPE_KEY)
                        value = await judge(request.url.path, shared if isinstance(shared, SharedBody) else body)
                    elif len(body) >= OFF_LOOP_BYTES:
                        async with _one_large_parse():
                            value = await asyncio.to_thread(parse_json_body, body)
                    else:
                        value = parse_json_body(body)
                    request._json = value  # Starlette's cache: FastAPI's request.json() returns it
            return await handler(request)

        return safe_handler
