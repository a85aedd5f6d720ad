"""One error hierarchy for the whole project.

Every error a client can see is a ``ChatfleetError`` with an HTTP status and an OpenAI error
``type``/``code``. Foreign exceptions are mapped to these at the edge (server, gateway, CLI);
``protocol.errors.error_response`` turns one into OpenAI error JSON, in exactly one place.
"""

from __future__ import annotations


class ChatfleetError(Exception):
    """Base of every error chatfleet raises on purpose."""

    status_code: int = 500
    error_type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class ConfigError(ChatfleetError, ValueError):
    """A configuration value is invalid (raised while building frozen config dataclasses)."""

    status_code = 500
    error_type = "config_error"


class KVIntegrityError(ChatfleetError, AssertionError):
    """A KV memory structure is inconsistent (a bug, never a client error)."""


class InvalidRequestError(ChatfleetError, ValueError):
    """The client's request is malformed or can never be served (HTTP 400)."""

    status_code = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve (HTTP 404, as OpenAI and vLLM)."""

    status_code = 404
    code = "model_not_found"


class NotFoundError(ChatfleetError):
    """No such route or resource (HTTP 404)."""

    status_code = 404
    error_type = "not_found_error"
    code = "not_found"


class RequestTimeoutError(ChatfleetError):
    """The request ran past the server's per-request deadline (HTTP 408); it was aborted."""

    status_code = 408
    error_type = "timeout_error"
    code = "request_timeout"


class RequestTooLongError(InvalidRequestError):
    """Prompt plus max_tokens can never fit the KV pool or the model's context."""

    code = "context_length_exceeded"


class AuthenticationError(ChatfleetError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class PayloadTooLargeError(ChatfleetError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class RateLimitError(ChatfleetError):
    """Admission refused: the queue is full or the wait too long (HTTP 429, with Retry-After)."""

    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **kw) -> None:
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


class ServerOverloadedError(ChatfleetError):
    """The engine's waiting queue is full (HTTP 503, with Retry-After)."""

    status_code = 503
    error_type = "server_overloaded"
    code = "queue_full"
    retry_after_s: float = 1.0


class UpstreamError(ChatfleetError):
    """A replica failed or could not be reached (HTTP 502)."""

    status_code = 502
    error_type = "upstream_error"


class NoHealthyReplicaError(ChatfleetError):
    status_code = 503
    error_type = "server_overloaded"
    code = "no_healthy_replica"


class EngineDeadError(ChatfleetError):
    """The engine loop died; the server cannot serve any more requests."""

    status_code = 500
    error_type = "internal_error"
    code = "engine_dead"
