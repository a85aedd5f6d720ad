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
# Generation routes answer JSON, or server-sent events when the request streams.
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the reply, or with stream: true its chunks as server-sent events",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **ERROR_RESPONSES,
}


def below_pattern(n: int) -> str:
    """A regex of the decimal numbers 0 .. n - 1 (no leading zeros): token ids as logit_bias keys."""
    digits = str(n)
    alts = [r"0"] if n > 0 else []
    for width in range(1, len(digits)):  # every number with fewer digits
        alts.append(r"[1-9]" + r"[0-9]" * (width - 1) if width > 1 else r"[1-9]")
    for i, d in enumerate(digits):  # same width: a smaller digit at position i, free after it
        lo = 1 if i == 0 else 0
        if int(d) > lo:
            alts.append(digits[:i] + f"[{lo}-{int(d) - 1}]" + r"[0-9]" * (len(digits) - i - 1))
    return "^(" + "|".join(alts) + ")$"


def _engine_limits(schema: dict[str, Any], vocab_size: int, max_model_len: int) -> None:
    """What this engine refuses beyond the wire format, said in the document: text-only content
    parts, token ids below the vocabulary, at most a context's worth of tokens, completions with
    no suffix and best_of 1, and /tokenize's exactly-one-of prompt and messages."""
    defs = schema.get("components", {}).get("schemas", {})
    part = defs.get("ContentPart")
    if part:
        part["properties"]["type"] = {"type": "string", "enum": ["text"], "title": "Type"}
        part["properties"]["text"] = {"type": "string", "title": "Text"}
        part["required"] = ["type", "text"]

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            items = node.get("items")  # arrays of token ids (prompts, stop_token_ids)
            if isinstance(items, dict) and items.get("type") == "integer" and items.get("minimum") == 0:
                items["maximum"] = vocab_size - 1
            names = node.get("propertyNames")
            if isinstance(names, dict) and names.get("pattern") == "^[0-9]{1,12}$":
                names["pattern"] = below_pattern(vocab_size)
            for v in node.values():
                visit(v)
        elif isinstance(node, list):
            for v in node:
                visit(v)

    for name in ("ChatCompletionRequest", "CompletionRequest"):
        model = defs.get(name)
        if model:
            visit(model)
            for field in ("max_tokens", "max_completion_tokens"):
                for branch in model["properties"].get(field, {}).get("anyOf", []):
                    if branch.get("type") == "integer":
                        branch["maximum"] = max_model_len
    completion = defs.get("CompletionRequest")
    if completion:  # what serving.py refuses: no suffix, best_of 1 only
        for branch in completion["properties"].get("suffix", {}).get("anyOf", []):
            if branch.get("type") == "string":
                branch["maxLength"] = 0
        for branch in completion["properties"].get("best_of", {}).get("anyOf", []):
            if branch.get("type") == "integer":
                branch["maximum"] = 1
    tokenize = defs.get("TokenizeRequest")
    if tokenize:
        tokenize["oneOf"] = [
            {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
            {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]


def install_openapi(app: FastAPI, vocab_size: int | None = None, max_model_len: int | None = None) -> None:
    """Make ``app.openapi()`` drop FastAPI's 422 entries (this server never answers 422) and, with
    the model's sizes, state the engine's own limits (``_engine_limits``)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            if vocab_size is not None and max_model_len is not None:
                _engine_limits(schema, vocab_size, max_model_len)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the schema
