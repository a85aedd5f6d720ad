"""The one place that turns errors into OpenAI error JSON: ``{"error": {message, type, param, code}}``.

Servers (engine, gateway) call ``install_exception_handlers(app)``; routes just raise.
Foreign exceptions (pydantic validation, bad JSON, Starlette HTTP errors) are mapped to
``ChatfleetError`` by ``to_chatfleet_error``.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from chatfleet.errors import (
    AuthenticationError,
    ChatfleetError,
    InvalidRequestError,
    NotFoundError,
    RateLimitError,
    ServerOverloadedError,
)
from chatfleet.protocol.openai import ErrorInfo, ErrorResponse
from chatfleet.protocol.sse import encode_event

log = logging.getLogger(__name__)

_MAX_LISTED = 3


def _format_validation(errors: Iterable[Mapping[str, Any]]) -> tuple[str, str | None]:
    """(message, param) from pydantic/FastAPI error dicts."""
    parts: list[str] = []
    param: str | None = None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            detail = ctx.get("error") or err.get("msg", "")
            return f"malformed JSON body: {detail}", None
        msg = str(err.get("msg", "invalid value"))
        if not loc and err.get("type") == "missing":
            msg = "the request body is missing; send a JSON object"
        elif not loc and err.get("type") in ("model_type", "model_attributes_type", "dict_type"):
            msg = "the request body must be a JSON object"
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        text = f"{where}: {msg}" if where else msg
        if text not in parts:
            parts.append(text)
    if not parts:
        return "invalid request", None
    more = len(parts) - _MAX_LISTED
    message = "; ".join(parts[:_MAX_LISTED]) + (f" (and {more} more)" if more > 0 else "")
    return message, param


def _http_error(status: int, message: str) -> ChatfleetError:
    err = ChatfleetError(message)
    err.status_code = status
    err.error_type = "not_found_error" if status == 404 else (
        "invalid_request_error" if 400 <= status < 500 else "internal_error"
    )
    return err


def to_chatfleet_error(exc: BaseException) -> ChatfleetError:
    """Map any exception to a ChatfleetError (client errors to 4xx, anything unknown to 500)."""
    if isinstance(exc, ChatfleetError):
        return exc
    if isinstance(exc, (RequestValidationError, ValidationError)):
        message, param = _format_validation(list(exc.errors()))
        return InvalidRequestError(message, param=param)
    if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError)):
        return InvalidRequestError(f"malformed JSON body: {exc}")
    if isinstance(exc, StarletteHTTPException):
        if exc.status_code == 404:
            return NotFoundError("no such route on this server")
        return _http_error(exc.status_code, str(exc.detail))
    # What went wrong inside stays in the server log; the client learns only that it did.
    return _http_error(500, "internal server error; the server log has the details")


def error_payload(exc: BaseException) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` for any exception."""
    err = to_chatfleet_error(exc)
    info = ErrorInfo(message=err.message, type=err.error_type, param=err.param, code=err.code)
    return ErrorResponse(error=info).model_dump()


def error_response(exc: BaseException) -> JSONResponse:
    """A Starlette response with the error's HTTP status (and Retry-After when rate limited)."""
    err = to_chatfleet_error(exc)
    headers = {}
    if isinstance(err, (RateLimitError, ServerOverloadedError)):
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    if isinstance(err, AuthenticationError):
        headers["WWW-Authenticate"] = 'Bearer realm="chatfleet"'
    return JSONResponse(error_payload(err), status_code=err.status_code, headers=headers)


def error_event(exc: BaseException) -> bytes:
    """The error as one SSE event, for failures after a stream has started (as vLLM does)."""
    return encode_event(error_payload(exc))


def install_exception_handlers(app: FastAPI) -> None:
    """Route every error raised by ``app``'s handlers through ``error_response``."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        err = to_chatfleet_error(exc)
        if err.status_code >= 500:
            error_id = uuid.uuid4().hex[:16]
            log.error("%s %s failed (error id %s): %s", request.method, request.url.path, error_id,
                      err.message if err is exc else repr(exc),
                      exc_info=exc if not isinstance(exc, ChatfleetError) else None)
            if err is not exc:  # a foreign exception: the client gets the id to quote, no internals
                err = _http_error(err.status_code, f"{err.message} (error id {error_id})")
        response = error_response(err)
        if isinstance(exc, StarletteHTTPException) and exc.headers:  # e.g. a 405's Allow
            response.headers.update(exc.headers)
        return response

    for exc_type in (ChatfleetError, RequestValidationError, ValidationError,
                     json.JSONDecodeError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, handle)
