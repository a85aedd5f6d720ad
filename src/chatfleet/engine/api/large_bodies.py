"""Large request bodies judged in the tokenizing worker process, off the step loop's interpreter.

A body of a few hundred KB or more is parsed (``protocol.safe_json``), validated as its route's
request and measured there; the server's process gets back either a refusal (a few hundred
bytes, the same 400 it would have given) or the parsed value, which unpickles at memory speed
where ``json.loads`` would hold the GIL for every character. A chat or prompt that cannot fit
the context is refused in the worker without its text ever reaching the server's process:
by characters (``PromptLengthBound``) and by a count of its messages' tokens that stops as soon
as they pass the context.

The token count covers what every chat template renders: the texts of system, developer, user
and tool messages (a template may drop an assistant turn's reasoning; none drops a user's
words). Texts tokenized one by one can cover at most one token more than they do joined (a
boundary can split what one token would cover), so the count allows one token per message.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError
from tokenizers import Tokenizer

from chatfleet.engine.api.tokenize_process import TooManyTokens, encode_within
from chatfleet.errors import InvalidRequestError
from chatfleet.protocol.body_spool import SharedBody, body_bytes
from chatfleet.protocol.errors import to_chatfleet_error
from chatfleet.protocol.openai import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from chatfleet.protocol.safe_json import parse_json_body

REQUESTS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest] | type[TokenizeRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
    "/tokenize": TokenizeRequest}
COUNTED_ROLES = frozenset({"system", "developer", "user", "tool"})


@dataclass(frozen=True)
class BodyLimits:
    """What a body's prompt may hold: ``max_chars`` characters (None: no bound from characters)
    and ``max_tokens`` tokens (the context)."""

    max_tokens: int
    max_chars: int | None = None
    max_messages: int | None = None  # more messages than this cannot fit (None: no such bound)


@dataclass(frozen=True)
class Refused:
    """The body is refused: ``too_long`` says its prompt cannot fit (``messages`` messages,
    ``chars`` characters, or more than ``tokens`` tokens), else ``message`` says what is wrong."""

    message: str = ""
    param: str | None = None
    too_long: bool = False
    chars: int = 0
    tokens: int = 0
    messages: int = 0


def _texts(value: dict[str, object]) -> tuple[str, list[str], bool]:
    """(param, the prompt's texts, whether they are one chat's messages) of a validated body."""
    messages = value.get("messages")
    if isinstance(messages, list):
        texts = []
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in COUNTED_ROLES:
                continue
            content = m.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return "messages", texts, True
    prompt = value.get("prompt")
    if isinstance(prompt, str):
        return "prompt", [prompt], False
    if isinstance(prompt, list):
        return "prompt", [p for p in prompt if isinstance(p, str)], False
    return "prompt", [], False


def _count_within(tokenizer: Tokenizer, texts: list[str], limit: int) -> int | None:
    """The tokens of ``texts`` one by one, or None once they pass ``limit`` plus one per text."""
    count = 0
    for i, text in enumerate(texts):
        out = encode_within(tokenizer, text, limit + i + 1 - count)
        count += int(out) if isinstance(out, TooManyTokens) else len(out)
        if count > limit + i + 1:
            return None
    return count


def judge_body(tokenizer: Tokenizer, path: str, body: bytes | SharedBody, limits: BodyLimits) -> object:
    """The parsed body, or ``Refused``: parse, validation, then the prompt's size (a shared body
    read here, in the worker, from the server's memory file)."""
    try:
        value = parse_json_body(body_bytes(body))
    except InvalidRequestError as exc:
        return Refused(exc.message, exc.param)
    model = REQUESTS.get(path)
    if model is None or not isinstance(value, dict):
        return value  # the route says what is wrong, as it would without this
    try:
        model.model_validate(value)
    except ValidationError as exc:
        err = to_chatfleet_error(exc)
        return Refused(err.message, err.param)
    except RecursionError:
        return value
    messages = value.get("messages")
    if limits.max_messages is not None and isinstance(messages, list) and len(messages) > limits.max_messages:
        return Refused(param="messages", too_long=True, messages=len(messages))
    param, texts, chat = _texts(value)
    chars = sum(map(len, texts)) if chat else max(map(len, texts), default=0)
    if limits.max_chars is not None and chars > limits.max_chars:
        return Refused(param=param, too_long=True, chars=chars)
    if chat:
        if _count_within(tokenizer, texts, limits.max_tokens) is None:
            return Refused(param=param, too_long=True, tokens=limits.max_tokens)
    else:
        for text in texts:
            if _count_within(tokenizer, [text], limits.max_tokens) is None:
                return Refused(param=param, too_long=True, tokens=limits.max_tokens)
    return value
