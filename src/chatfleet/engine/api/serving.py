"""OpenAI requests to engine inputs (prompt ids, SamplingParams) and engine outputs to responses.

Pure functions of the tokenizer and the request: no I/O, so the routes in server.py stay thin.
What the built-in engine does not support (suffix, best_of) is refused here with 400; a request's
grammar (``response_format``, a forced ``tool_choice``) comes from ``structured_output.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jinja2

from chatfleet.engine.api.structured_output import RequestGrammar
from chatfleet.engine.outputs import RequestOutput, TokenLogprob
from chatfleet.engine.request import SamplingParams
from chatfleet.errors import InvalidRequestError, RequestTooLongError
from chatfleet.protocol.openai import (
    ChatCompletionRequest,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    SamplingFields,
    TopLogprob,
    Usage,
)

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: role, text content, and tool calls / call ids."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
            "name": c.function.name, "arguments": c.function.arguments}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template renders them; None when tools are off.

    A forced ``tool_choice`` ("required" or a named function) renders the tools as "auto" does;
    its grammar (``structured_output.request_grammar``) makes the reply calls.
    """
    if req.tool_choice is not None and not req.tools:
        raise InvalidRequestError("tool_choice is set but no tools are given", param="tool_choice")
    if not req.tools_active:
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools or ()]


def render_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None, *,
                check_text: Callable[[str, str], None] | None = None) -> str:
    """The chat template's text; ``check_text(text, param)`` may refuse it."""
    plain = [template_message(m) for m in messages]
    extra = {"tools": tools} if tools else {}
    try:
        text = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, **extra)
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
    if check_text is not None:
        check_text(text, "messages")
    return text


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None, *,
                    check_text: Callable[[str, str], None] | None = None) -> list[int]:
    """Render the chat template and encode it; ``check_text(text, param)`` may refuse the text first."""
    return tokenizer.encode(render_chat(tokenizer, messages, add_generation_prompt, tools, check_text=check_text))


@dataclass(frozen=True)
class CompletionPrompt:
    token_ids: list[int]
    text: str


def completion_prompt(tokenizer: Any, prompt: str | list[int]) -> CompletionPrompt:
    """One prompt of a completions request (a text or token ids), as token ids and text."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return CompletionPrompt(tokenizer.encode(prompt), prompt)
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is not None and any(t >= vocab for t in prompt):
        raise InvalidRequestError(f"token ids must be below the vocabulary size {vocab}", param="prompt")
    try:  # echo shows special tokens as they are, as HF's decode does by default
        text = tokenizer.decode(prompt, skip_special_tokens=False)
    except TypeError:
        text = tokenizer.decode(prompt)
    return CompletionPrompt(list(prompt), text)


def _common(req: SamplingFields, grammar: RequestGrammar | None) -> dict[str, Any]:
    return dict(
        grammar=grammar.spec if grammar is not None else None,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0,
        logit_bias=tuple(sorted(req.logit_bias_ids.items())),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        seed=None if req.seed is None else req.seed % 2**64,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop=tuple(req.stop_list),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        include_stop_str_in_output=req.include_stop_str_in_output,
    )


def check_token_ids(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """Refuse logit_bias entries and stop_token_ids for tokens this model does not have."""
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            f"logit_bias names token {bad[0]}, outside the vocabulary (0..{vocab_size - 1})", param="logit_bias")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            f"stop_token_ids names token {bad[0]}, outside the vocabulary (0..{vocab_size - 1})",
            param="stop_token_ids")
    return params


def _default_max_tokens(prompt_len: int, max_request_tokens: int) -> int:
    """Without max_tokens, a reply may fill what is left of the context (and the KV pool)."""
    room = max_request_tokens - prompt_len
    if room < 1:
        raise RequestTooLongError(
            f"the prompt has {prompt_len} tokens; a request may hold at most {max_request_tokens}"
            " tokens on this server (context length and KV pool)",
            param="messages",
        )
    return room


def chat_sampling_params(req: ChatCompletionRequest, prompt_len: int, max_request_tokens: int,
                         grammar: RequestGrammar | None = None) -> SamplingParams:
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = _default_max_tokens(prompt_len, max_request_tokens)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **_common(req, grammar))


def completion_sampling_params(req: CompletionRequest, prompt_len: int, max_request_tokens: int,
                               grammar: RequestGrammar | None = None) -> SamplingParams:
    """max_tokens=0 runs one token that the response drops (scoring a prompt, as vLLM does)."""
    if req.best_of not in (None, 1):
        raise InvalidRequestError("only best_of=1 is supported", param="best_of")
    if req.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = _default_max_tokens(prompt_len, max_request_tokens)
    prompt_logprobs = req.logprobs if (req.echo and req.logprobs is not None) else None
    common = _common(req, grammar)
    if max_tokens == 0:
        common["min_tokens"] = 0
    return SamplingParams(
        max_tokens=max(1, max_tokens), logprobs=req.logprobs, prompt_logprobs=prompt_logprobs, **common
    )


def usage_of(out: RequestOutput | None, *, num_output_tokens: int | None = None) -> Usage:
    if out is None:
        return Usage()
    completion = out.num_output_tokens if num_output_tokens is None else num_output_tokens
    return Usage(
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=completion,
        total_tokens=out.num_prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=max(0, out.num_cached_tokens)),
    )


class TokenText:
    """Decoded text of single tokens, memoized per request (logprob listings repeat tokens).

    ``as_ids``: each token is written ``token_id:N`` instead (vLLM's return_tokens_as_token_ids),
    so a client gets the exact ids, e.g. to score a reply token by token.
    """

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self._text = getattr(tokenizer, "token_text", None) or (lambda t: tokenizer.decode([t]))
        if as_ids:
            self._text = "token_id:{}".format
        self._memo: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._memo.get(token_id)
        if s is None:
            s = self._memo[token_id] = self._text(token_id)
        return s


def _clamp(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB


def chat_logprobs(text: TokenText, lps: list[TokenLogprob], k: int) -> ChatLogprobs:
    content = []
    for lp in lps:
        s = text(lp.token_id)
        top = [TopLogprob(token=text(t), logprob=_clamp(v), bytes=list(text(t).encode()))
               for t, v in lp.top[:k]]
        content.append(ChatLogprobToken(token=s, logprob=_clamp(lp.logprob),
                                        bytes=list(s.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


class CompletionLogprobsBuilder:
    """Legacy completions logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, text: TokenText, k: int) -> None:
        self.text = text
        self.k = k
        self.offset = 0

    def build(self, token_ids: list[int], lps: list[TokenLogprob | None]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for tid, lp in zip(token_ids, lps, strict=True):
            s = self.text(tid)
            out.tokens.append(s)
            out.text_offset.append(self.offset)
            self.offset += len(s)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            top = {self.text(t): _clamp(v) for t, v in lp.top[: self.k]}
            top.setdefault(s, _clamp(lp.logprob))
            out.token_logprobs.append(_clamp(lp.logprob))
            out.top_logprobs.append(top)
        return out


def merge_completion_logprobs(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    merged = CompletionLogprobs()
    for p in parts:
        merged.tokens += p.tokens
        merged.token_logprobs += p.token_logprobs
        merged.top_logprobs += p.top_logprobs
        merged.text_offset += p.text_offset
    return merged
