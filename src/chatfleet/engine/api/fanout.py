"""Several choices in one response: ``n`` > 1 and batched completions prompts.

Each choice is one engine request, ``<parent id>-<index>``. The first choice of each prompt
runs its prefill alone; the others start once it has produced its first token, so they find the
prompt's blocks in the prefix cache and share them instead of computing them again. Choices of
one request are numbered as OpenAI numbers them: prompt ``i``, sample ``j`` -> ``i * n + j``.
Streamed, the choices' chunks are interleaved as they come (``interleave``), each carrying its
choice's index, followed by one usage chunk (when asked) and one ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from chatfleet.engine.api.requests import Deadline, RequestOutputs, ServerState
from chatfleet.engine.api.responders import StreamPart
from chatfleet.engine.request import SamplingParams
from chatfleet.errors import InvalidRequestError
from chatfleet.protocol.errors import error_event
from chatfleet.protocol.openai import ChatCompletionResponse, CompletionResponse, PromptTokensDetails, Usage
from chatfleet.protocol.sse import DONE

MAX_CHOICES = 128

Response = TypeVar("Response", ChatCompletionResponse, CompletionResponse)


@dataclass(frozen=True)
class Choice:
    """One engine request of a fanned-out HTTP request."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


def plan_choices(prompts: list[tuple[list[int], SamplingParams]], n: int) -> list[Choice]:
    """``n`` choices per prompt; a seeded request gets seeds ``seed + j`` so its samples differ."""
    if len(prompts) * n > MAX_CHOICES:
        raise InvalidRequestError(f"at most {MAX_CHOICES} choices (prompts times n) per request", param="n")
    choices = []
    for i, (ids, params) in enumerate(prompts):
        for j in range(n):
            p = params if params.seed is None or j == 0 else dataclasses.replace(params, seed=params.seed + j)
            choices.append(Choice(i * n + j, i, ids, p))
    return choices


async def start_choices(state: ServerState, parent_id: str, choices: list[Choice], cache_salt: str | None,
                        session_id: str | None, deadline: Deadline) -> list[RequestOutputs]:
    """Start every choice (first of each prompt first); on any refusal, abort the started ones."""
    started: dict[int, RequestOutputs] = {}

    async def start(c: Choice) -> None:
        started[c.index] = await state.start(f"{parent_id}-{c.index}", c.prompt_ids, c.params, cache_salt,
                                             session_id, deadline)

    firsts = {c.prompt_index: c for c in reversed(choices)}
    try:
        await asyncio.gather(*(start(c) for c in firsts.values()))
        await asyncio.gather(*(start(c) for c in choices if c.index not in started))
    except BaseException:
        for outputs in started.values():
            await outputs.aclose()
        raise
    return [started[c.index] for c in choices]


def merged_usage(usages: list[Usage | None], choices: list[Choice]) -> Usage:
    """Prompt tokens once per prompt, completion tokens of every choice."""
    prompt = cached = completion = 0
    seen: set[int] = set()
    for u, c in zip(usages, choices, strict=True):
        if u is None:
            continue
        completion += u.completion_tokens
        if c.prompt_index not in seen:
            seen.add(c.prompt_index)
            prompt += u.prompt_tokens
            cached += u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def merge_responses(responses: list[Response], choices: list[Choice]) -> Response:
    """One response with every choice (``index`` set) and the merged usage."""
    merged = [r.choices[0].model_copy(update={"index": c.index}) for r, c in zip(responses, choices, strict=True)]
    return responses[0].model_copy(update={"choices": merged,
                                           "usage": merged_usage([r.usage for r in responses], choices)})


async def interleave(streams: list[AsyncGenerator[bytes, None]], parts: list[StreamPart], choices: list[Choice],
                     usage_chunk: Callable[[Usage], bytes] | None) -> AsyncGenerator[bytes, None]:
    """One SSE stream of every choice's chunks as they come (each stream is a responder run as a
    ``StreamPart``), then the merged usage (``usage_chunk``, when asked) and ``[DONE]``. An error
    in any choice ends the whole stream with an error event."""
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[bytes, None]) -> None:
        try:
            async with aclosing(stream):
                async for event in stream:
                    await queue.put(event)
        except Exception as exc:  # noqa: BLE001 - handed to the merged stream
            await queue.put(exc)
            return
        await queue.put(None)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                yield error_event(item)
                break
            else:
                yield item
        else:
            if usage_chunk is not None:
                yield usage_chunk(merged_usage([p.usage for p in parts], choices))
        yield DONE
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
