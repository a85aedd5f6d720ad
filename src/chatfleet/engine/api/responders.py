"""Build chat and legacy-completion responses (whole or as SSE) from a request's output stream.

With tools in a chat request, the reply text goes through the model's tool-call parser
(``tool_parsers.py``): calls become ``tool_calls`` (streamed as ``delta.tool_calls``), and a
reply that called a tool and stopped by itself finishes with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from chatfleet.engine.api.serving import (
    CompletionLogprobsBuilder,
    CompletionPrompt,
    TokenText,
    chat_logprobs,
    merge_completion_logprobs,
    usage_of,
)
from chatfleet.engine.api.tool_parsers import TOOL_PARSERS, ParsedCall, StreamEvent
from chatfleet.engine.outputs import RequestOutput, TokenLogprob
from chatfleet.protocol.errors import error_event
from chatfleet.protocol.openai import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCall,
    Usage,
    now_s,
    random_id,
)
from chatfleet.protocol.sse import DONE, encode_event


class OutputStream(Protocol):
    """A request's outputs, iterated once and closed when the response is done (closing aborts an
    unfinished request): ``requests.RequestOutputs``, or any async generator of outputs."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def aclose(self) -> None: ...


@dataclass
class StreamPart:
    """One choice's share of a fanned-out stream (``fanout.interleave``): its index, and its
    usage once it has finished."""

    index: int
    usage: Usage | None = None


@dataclass(frozen=True)
class ResponseContext:
    request_id: str
    model: str
    tokenizer: Any
    created: int
    tool_parser: str = "qwen3"  # the served model's tool-call format (TOOL_PARSERS)


def _stop_reason(out: RequestOutput) -> int | str | None:
    return out.stop_reason if out.finished else None


def _finish_reason(out: RequestOutput, called: bool) -> str | None:
    if not out.finished:
        return None
    return "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(function=FunctionCallOut(name=call.name, arguments=call.arguments))


# ------------------------------------------------------------------ chat


async def chat_response(
    ctx: ResponseContext, req: ChatCompletionRequest, outputs: OutputStream
) -> ChatCompletionResponse:
    text: list[str] = []
    lps: list[TokenLogprob] = []
    last: RequestOutput | None = None
    async with aclosing(outputs):
        async for out in outputs:
            text.append(out.new_text)
            lps += out.logprobs or []
            last = out
    text_of = TokenText(ctx.tokenizer, req.return_tokens_as_token_ids)
    logprobs = chat_logprobs(text_of, lps, req.top_logprobs or 0) if req.logprobs else None
    reply = "".join(text)
    content: str | None = reply
    calls: list[ToolCall] | None = None
    if req.tools_active:
        parsed = TOOL_PARSERS.make(ctx.tool_parser).parse(reply)
        content, calls = parsed.content, [_tool_call(c) for c in parsed.calls] or None
    choice = ChatCompletionChoice(
        message=ChatResponseMessage(content=content, tool_calls=calls),
        logprobs=logprobs,
        finish_reason=_finish_reason(last, bool(calls)) if last else None,
        stop_reason=last.stop_reason if last else None,
    )
    return ChatCompletionResponse(
        id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[choice], usage=usage_of(last)
    )


async def chat_stream(
    ctx: ResponseContext, req: ChatCompletionRequest, outputs: OutputStream,
    part: StreamPart | None = None,
) -> AsyncGenerator[bytes, None]:
    """SSE events: a role chunk, content chunks, the finish chunk, then usage if asked, [DONE].
    As ``part`` of a fanned-out stream: its chunks only, numbered ``part.index``; the usage goes
    to ``part.usage`` and an error is raised (the merged stream ends both)."""
    index = part.index if part is not None else 0
    text = TokenText(ctx.tokenizer, req.return_tokens_as_token_ids)
    continuous = bool(req.include_usage and req.stream_options and req.stream_options.continuous_usage_stats)

    def chunk(choices: list[ChatCompletionChunkChoice], usage=None) -> bytes:
        return encode_event(ChatCompletionChunk(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=usage
        ))

    parser = TOOL_PARSERS.make(ctx.tool_parser).stream() if req.tools_active else None
    num_calls = 0

    async with aclosing(outputs):
        try:
            yield chunk([ChatCompletionChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            last = None
            async for out in outputs:
                last = out
                lp = chat_logprobs(text, out.logprobs or [], req.top_logprobs or 0) if req.logprobs else None
                new_text = out.new_text
                deltas: list[DeltaToolCall] | None = None
                if parser is not None:
                    events: list[StreamEvent] = parser.feed(out.new_text)
                    if out.finished:
                        events += parser.finish()
                    new_text = "".join(e.content for e in events)
                    calls: list[DeltaToolCall] = []
                    for e in events:
                        if e.call is not None:
                            calls.append(DeltaToolCall(index=num_calls, id=random_id("call"), type="function",
                                                        function=DeltaFunctionCall(name=e.call.name,
                                                                                   arguments=e.call.arguments)))
                            num_calls += 1
                    deltas = calls or None
                if not (new_text or deltas or out.finished or (lp and lp.content)):
                    continue  # e.g. a token that ends inside a multi-byte character
                choice = ChatCompletionChunkChoice(
                    index=index,
                    delta=DeltaMessage(content=new_text or ("" if not (out.finished or deltas) else None),
                                       tool_calls=deltas),
                    logprobs=lp,
                    finish_reason=_finish_reason(out, num_calls > 0),
                    stop_reason=_stop_reason(out),
                )
                yield chunk([choice], usage_of(out) if continuous else None)
            if part is not None:
                part.usage = usage_of(last)
                return
            if req.include_usage:
                yield chunk([], usage_of(last))
        except Exception as exc:  # noqa: BLE001 - after the headers, errors go in-band
            if part is not None:
                raise
            yield error_event(exc)
        yield DONE


# ------------------------------------------------------------------ legacy completions


@dataclass(frozen=True)
class _Piece:
    text: str
    logprobs: CompletionLogprobs | None


class _CompletionPieces:
    """Text and logprobs of one completion output, with echo and max_tokens=0 applied."""

    def __init__(self, ctx: ResponseContext, req: CompletionRequest, prompt: CompletionPrompt) -> None:
        self.req = req
        self.prompt = prompt
        self.drop_generated = req.max_tokens == 0
        self.lp = (CompletionLogprobsBuilder(TokenText(ctx.tokenizer, req.return_tokens_as_token_ids), req.logprobs)
                   if req.logprobs is not None else None)
        self.first = True

    def piece(self, out: RequestOutput) -> _Piece:
        parts, lps = [], []
        if self.first and self.req.echo:
            parts.append(self.prompt.text)
            if self.lp is not None:
                plp = out.prompt_logprobs or [None] * len(self.prompt.token_ids)
                lps.append(self.lp.build(self.prompt.token_ids, list(plp)))
        self.first = False
        if not self.drop_generated:
            parts.append(out.new_text)
            if self.lp is not None:
                generated: list[TokenLogprob | None] = (
                    list(out.logprobs) if out.logprobs else [None] * len(out.new_token_ids))
                lps.append(self.lp.build(out.new_token_ids, generated))
        return _Piece("".join(parts), merge_completion_logprobs(lps) if self.lp is not None else None)

    def finish_reason(self, out: RequestOutput) -> str | None:
        if not out.finished:
            return None
        return "length" if self.drop_generated else out.finish_reason

    def usage(self, out: RequestOutput | None):
        return usage_of(out, num_output_tokens=0 if self.drop_generated else None)


async def completion_response(
    ctx: ResponseContext, req: CompletionRequest, prompt: CompletionPrompt,
    outputs: OutputStream,
) -> CompletionResponse:
    pieces = _CompletionPieces(ctx, req, prompt)
    text, lps, last = [], [], None
    async with aclosing(outputs):
        async for out in outputs:
            piece = pieces.piece(out)
            text.append(piece.text)
            if piece.logprobs is not None:
                lps.append(piece.logprobs)
            last = out
    choice = CompletionChoice(
        text="".join(text),
        logprobs=merge_completion_logprobs(lps) if pieces.lp is not None else None,
        finish_reason=pieces.finish_reason(last) if last else None,
        stop_reason=last.stop_reason if last and not pieces.drop_generated else None,
    )
    return CompletionResponse(
        id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[choice], usage=pieces.usage(last)
    )


async def completion_stream(
    ctx: ResponseContext, req: CompletionRequest, prompt: CompletionPrompt,
    outputs: OutputStream, part: StreamPart | None = None,
) -> AsyncGenerator[bytes, None]:
    """SSE events: text chunks, then usage if asked, [DONE]; ``part``: as in ``chat_stream``."""
    index = part.index if part is not None else 0
    pieces = _CompletionPieces(ctx, req, prompt)
    continuous = bool(req.include_usage and req.stream_options and req.stream_options.continuous_usage_stats)

    def chunk(choices: list[CompletionChoice], usage=None) -> bytes:
        return encode_event(CompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=usage
        ))

    async with aclosing(outputs):
        try:
            last = None
            async for out in outputs:
                last = out
                piece = pieces.piece(out)
                if not (piece.text or out.finished or (piece.logprobs and piece.logprobs.tokens)):
                    continue
                choice = CompletionChoice(
                    index=index, text=piece.text, logprobs=piece.logprobs, finish_reason=pieces.finish_reason(out),
                    stop_reason=None if pieces.drop_generated else _stop_reason(out),
                )
                yield chunk([choice], pieces.usage(out) if continuous else None)
            if part is not None:
                part.usage = pieces.usage(last)
                return
            if req.include_usage:
                yield chunk([], pieces.usage(last))
        except Exception as exc:  # noqa: BLE001 - after the headers, errors go in-band
            if part is not None:
                raise
            yield error_event(exc)
        yield DONE


def chat_usage_chunk(ctx: ResponseContext, usage: Usage) -> bytes:
    """The usage chunk that ends a streamed chat response (no choices)."""
    return encode_event(ChatCompletionChunk(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[],
                                            usage=usage))


def completion_usage_chunk(ctx: ResponseContext, usage: Usage) -> bytes:
    """The usage chunk that ends a streamed completion response (no choices)."""
    return encode_event(CompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[],
                                           usage=usage))


def new_context(request_id: str, model: str, tokenizer: Any) -> ResponseContext:
    return ResponseContext(request_id=request_id, model=model, tokenizer=tokenizer, created=now_s())
