"""The gateway's OpenAPI document, served at ``/openapi.json``.

The proxied routes read their body as raw bytes (validated once, then passed on untouched), so
FastAPI cannot describe them from their handlers. Here each gets a stub endpoint typed with its
OpenAI request and reply models, and the error replies the gateway gives (400 included); the
stubs only feed ``get_openapi`` and never serve a request.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from chatfleet.gateway.body import ENDPOINTS
from chatfleet.protocol.openai import ChatCompletionResponse, CompletionResponse, ErrorResponse, ModelList

_REPLIES = {"/v1/chat/completions": ChatCompletionResponse, "/v1/completions": CompletionResponse}
_ERRORS = {
    400: "The request is malformed or names a model not served here",
    401: "Missing or invalid API key",
    404: "The request names a model no replica serves",
    413: "The request body is over the gateway's limit",
    429: "Over capacity: retry after the Retry-After header's seconds",
    502: "No replica could serve the request",
    503: "No healthy replica, or every replica is busy",
}
_STREAM = ("With `\"stream\": true` the reply is `text/event-stream`: one chunk object per "
           "`data:` event, then `data: [DONE]`.")


def _stub(name: str, body_model: type | None = None) -> Callable[..., Coroutine[Any, Any, None]]:
    async def endpoint(*args: Any, **kwargs: Any) -> None:  # pragma: no cover - never served
        raise RuntimeError("documentation stub")

    params = [] if body_model is None else [
        inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=body_model)]
    endpoint.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    endpoint.__name__ = name
    return endpoint


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


# Generation routes answer JSON, or server-sent events when the request streams.
_GENERATED = {"description": "The reply, or with stream: true its chunks as server-sent events",
              "content": {"application/json": {}, "text/event-stream": {}}}


def gateway_openapi(title: str, version: str) -> dict[str, Any]:
    routes = []
    for path, request_model in ENDPOINTS.items():
        name = path.rsplit("/", 1)[-1].replace(".", "_")
        routes.append(APIRoute(path, _stub(name, request_model), methods=["POST"],
                               response_model=_REPLIES[path], description=_STREAM,
                               responses={200: _GENERATED, **_errors(400, 401, 404, 413, 429, 502, 503)}))
    routes += [
        APIRoute("/v1/models", _stub("models"), methods=["GET"], response_model=ModelList,
                 description="Models of the healthy replicas.", responses=_errors(401)),
        APIRoute("/health", _stub("health"), methods=["GET"],
                 description="200 while some replica is healthy, else 503.", responses=_errors(503)),
        APIRoute("/metrics", _stub("metrics"), methods=["GET"], description="Prometheus text format.",
                 responses={200: {"description": "The gateway's series", "content": {"text/plain": {}}}}),
        APIRoute("/gateway/status", _stub("gateway_status"), methods=["GET"],
                 description="Replica states, caps, queues and shed counts as JSON.", responses=_errors(401)),
    ]
    doc = get_openapi(title=title, version=version, routes=routes)
    for operations in doc["paths"].values():  # FastAPI's own 422: the gateway answers 400 instead
        for operation in operations.values():
            operation["responses"].pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        doc.get("components", {}).get("schemas", {}).pop(name, None)
    return doc
