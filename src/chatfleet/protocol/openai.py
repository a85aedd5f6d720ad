"""OpenAI wire models (pydantic), with the vLLM extensions chatfleet accepts.

These describe the wire format only, so the gateway and the bench can validate and build
requests for any OpenAI-compatible server. What the built-in engine supports (n=1, no
penalties, ...) is checked where a request becomes ``SamplingParams`` (engine/api/serving.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.json_schema import JsonDict, WithJsonSchema

from chatfleet.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries; OpenAI's own limit is lower
MAX_ID_CHARS = 256  # model names, user ids, cache salts


def integral(v: object) -> object:
    """JSON Schema's integers include 2.0: an integral float is that integer (1.5 stays refused),
    in lists too (token ids)."""
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
        return int(v)
    if isinstance(v, list):
        return [integral(x) for x in v]
    return v


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class _Wire(BaseModel):
    """Request-side model: unknown fields are kept (so a proxy can re-serialize faithfully).

    Strict as OpenAI is: a boolean is not a number, ``"yes"`` is not a boolean, ``2.0`` is not
    an integer (an integer is a fine float)."""

    model_config = ConfigDict(extra="allow", strict=True)


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- requests


class StreamOptions(_Wire):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(_Wire):
    type: str
    text: str | None = None


class FunctionDefinition(_Wire):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema


class ToolDefinition(_Wire):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(_Wire):
    name: str


class NamedToolChoice(_Wire):
    """``tool_choice`` naming the one function the reply must call."""

    type: Literal["function"]
    function: ToolChoiceFunction


class FunctionCall(_Wire):
    name: str
    arguments: str  # a JSON object, as text


class MessageToolCall(_Wire):
    """A tool call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers

    def text(self) -> str:
        """The message's text; only text content parts are allowed (models here are text-only)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(
                    f"content part type {part.type!r} is not supported; only 'text' parts are",
                    param="messages",
                )
            out.append(part.text)
        return "".join(out)


class JsonSchemaFormat(_Wire):
    name: str = Field(default="response", max_length=MAX_ID_CHARS)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Wire):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""

    model_config = ConfigDict(json_schema_extra={"allOf": [{  # the rule _schema enforces
        "if": {"required": ["type"], "properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {
            "type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}}}}]})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object")
        if self.type == "json_schema" and self.json_schema is not None and self.json_schema.schema_ is None:
            raise ValueError("type 'json_schema' needs a 'schema' object in 'json_schema'")  # as the document says
        return self


def _check_stop(v: str | list[str] | None) -> str | list[str] | None:
    stops = [v] if isinstance(v, str) else (v or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
    if any(s == "" for s in stops):
        raise ValueError("stop strings must be non-empty")
    return v


# Rules between fields, as JSON Schema states them (the validators below enforce them).
STREAM_OPTIONS_RULE: JsonDict = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
TOP_LOGPROBS_RULE: JsonDict = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}
TOOL_CHOICE_RULE: JsonDict = {
    "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"type": "null"}}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}


class SamplingFields(_Wire):
    """Sampling fields shared by chat and legacy completions (OpenAI + vLLM extensions)."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"allOf": [STREAM_OPTIONS_RULE]})

    model: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension
    seed: int | None = None  # any integer; the engine draws from it modulo 2**64
    stop: Annotated[str | list[str] | None, WithJsonSchema({"anyOf": [  # as _check_stop refuses
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
        {"type": "null"}]})] = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # extension
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)  # extension (HF/vLLM)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension
    logit_bias: Annotated[dict[str, float] | None, WithJsonSchema({  # token id (as a string) -> bias
        "anyOf": [{"type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]{1,12}$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
                  {"type": "null"}]})] = None
    response_format: ResponseFormat | None = None
    min_tokens: int = Field(default=0, ge=0)  # extension
    ignore_eos: bool = False  # extension
    include_stop_str_in_output: bool = False  # extension
    cache_salt: str | None = Field(default=None, max_length=MAX_ID_CHARS)  # extension: prefix-cache key
    return_tokens_as_token_ids: bool = False  # extension: logprob tokens as "token_id:N"

    @field_validator("top_k", "seed", "n", "min_tokens", "stop_token_ids", mode="before")
    @classmethod
    def _integral(cls, v: object) -> object:
        return integral(v)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries are allowed")
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): float(b) for k, b in (self.logit_bias or {}).items()}

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        return _check_stop(v)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _stream_opts(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow", strict=True,
                              json_schema_extra={"allOf": [STREAM_OPTIONS_RULE, TOOL_CHOICE_RULE,
                                                                  TOP_LOGPROBS_RULE]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True  # extension
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @field_validator("max_tokens", "max_completion_tokens", "top_logprobs", mode="before")
    @classmethod
    def _integral_chat(cls, v: object) -> object:
        return integral(v)

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _tool_choice(self) -> ChatCompletionRequest:  # TOOL_CHOICE_RULE, as OpenAI refuses it
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice is only allowed when tools are given")
        return self

    @property
    def tools_active(self) -> bool:
        """Tools are rendered into the prompt and tool-call text is parsed from the reply."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# Validated by CompletionRequest._prompt (plain messages); the schema says the same rules.
PromptType = Annotated[str | list[int] | list[str] | list[list[int]], WithJsonSchema({"anyOf": [
    {"type": "string", "minLength": 1}, _TOKEN_IDS_SCHEMA,
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
    {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1}]})]


class CompletionRequest(SamplingFields):
    prompt: PromptType
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @field_validator("max_tokens", "logprobs", "best_of", "prompt", mode="before")
    @classmethod
    def _integral_completion(cls, v: object) -> object:
        return integral(v)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: PromptType) -> PromptType:
        if v == "" or (isinstance(v, list) and any(p == "" for p in v)):
            raise ValueError("prompt must not be empty")
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], list) and any(not p for p in v):
                raise ValueError("token-id prompts must not be empty")
            ids = v if isinstance(v[0], int) else (t for p in v if isinstance(p, list) for t in p)
            if any(t < 0 for t in ids):
                raise ValueError("token ids must be non-negative")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a text or a list of token ids."""
        v = self.prompt
        if isinstance(v, str):
            return [v]
        if v and isinstance(v[0], int):
            return [list(v)]
        return list(v)  # type: ignore[arg-type]  # v[0] is not an int, so (validated) no item is


class TokenizeRequest(_Wire):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


# ---------------------------------------------------------------- responses


class PromptTokensDetails(_Out):
    cached_tokens: int = 0


class Usage(_Out):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Out):
    content: list[ChatLogprobToken] | None = None


class FunctionCallOut(_Out):
    name: str
    arguments: str


class ToolCall(_Out):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaFunctionCall(_Out):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(_Out):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatResponseMessage(_Out):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler):  # no "tool_calls" key unless the model called a tool
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatCompletionChoice(_Out):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Out):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class DeltaMessage(_Out):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # a delta carries only the fields that changed
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionChunkChoice(_Out):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Out):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Out):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Out):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# A stream chunk of legacy completions has the same shape as the response.
CompletionChunk = CompletionResponse


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "chatfleet"
    root: str | None = None
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None  # tokens of context the engine's KV pool holds


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(_Out):
    tokens: list[int]
    count: int
    max_model_len: int


class ErrorInfo(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out):
    error: ErrorInfo
