"""The engine's OpenAPI document: the errors each route can answer, as they really are.

FastAPI declares 422 for validation errors; this server answers 400 (as OpenAI does), so the
document declares 400 (and the other statuses routes raise) with the OpenAI error body instead.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from chatfleet.protocol.openai import ErrorResponse

_ERRORS = {
    400: "invalid request: the message names the field",
    401: "missing or invalid API key (when the server has keys)",
    404: "unknown model or route",
    408: "the request ran past the server's deadline",
    413: "the request body is over the server's limit",
    503: "the engine's queue is full (Retry-After says when to come back)",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text} for code, text in _ERRORS.items()
}


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` drop FastAPI's 422 entries (this server never answers 422)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the schema
