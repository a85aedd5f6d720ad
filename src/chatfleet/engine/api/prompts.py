"""Prompts off the step loop: chat templates render on a bounded pool of threads, long texts
tokenize in a worker process.

A 10 MB prompt takes seconds to tokenize, and the ``tokenizers`` encoder holds the GIL while it
does (a thread would freeze the engine's step loop all the same), so ``PromptBuilder`` renders
on ``workers`` threads and encodes texts over a few KB in a worker process
(``tokenize_process.py``), which stops counting as soon as a text passes the context. Before
that, three bounds refuse what cannot fit without tokenizing it: a text of more than
``max_model_len * max_token_bytes`` characters (no token covers more than ``max_token_bytes``
bytes; times a slack where a normalizer may shrink the text); a chat whose messages' texts add
up to more than that; and a chat of more messages than the context holds, each rendered message
costing at least the template's own tokens for an empty one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from chatfleet.engine.api.large_bodies import BodyLimits, Refused, judge_body
from chatfleet.engine.api.serving import CompletionPrompt, completion_prompt, render_chat
from chatfleet.engine.api.tokenize_process import TokenizerProcesses, TooManyTokens
from chatfleet.errors import InvalidRequestError, RequestTooLongError
from chatfleet.protocol.body_spool import SharedBody, offered_by_name
from chatfleet.protocol.openai import ChatMessage

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_WORKERS = 2
# Unicode normalization can shrink a text (NFC composes Hangul jamo: 9 bytes -> 3).
_NORMALIZER_SLACK = {None: 1, "NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4}
# Pre-tokenizers that drop whitespace: the text length proves nothing.
_DROPPING_PRE_TOKENIZERS = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer", "CharDelimiterSplit"}


def _types(node: Any) -> set[str]:
    if not isinstance(node, dict):
        return set()
    kind = node.get("type")
    out = {kind} if isinstance(kind, str) and kind else set()
    for child in node.get("pretokenizers", []) + node.get("normalizers", []):
        out |= _types(child)
    return out


@dataclass(frozen=True)
class PromptLengthBound:
    """Texts longer than ``max_chars`` characters cannot fit the context (chars <= bytes)."""

    max_token_bytes: int
    slack: int
    max_model_len: int

    @property
    def max_chars(self) -> int:
        return self.max_model_len * self.max_token_bytes * self.slack

    @classmethod
    def of(cls, tokenizer: Any, max_model_len: int) -> PromptLengthBound | None:
        """The bound for a ``ChatTokenizer`` (None when its pipeline could drop text)."""
        backend = getattr(tokenizer, "backend", None)
        if backend is None:
            return None
        try:
            spec = json.loads(backend.to_str())
        except (AttributeError, ValueError):
            return None
        normalizer = spec.get("normalizer")
        norm_types = _types(normalizer) if normalizer else {None}
        if len(norm_types) != 1 or next(iter(norm_types)) not in _NORMALIZER_SLACK:
            return None
        if _types(spec.get("pre_tokenizer")) & _DROPPING_PRE_TOKENIZERS:
            return None
        vocab = backend.get_vocab(with_added_tokens=True)
        if not vocab:
            return None
        # A token string's UTF-8 length is at least the bytes it stands for (byte-level 'Ġ': 2 >= 1).
        longest = max(len(token.encode("utf-8")) for token in vocab)
        return cls(max_token_bytes=longest, slack=_NORMALIZER_SLACK[next(iter(norm_types))],
                   max_model_len=max_model_len)

    def check(self, text: str, param: str) -> None:
        if len(text) > self.max_chars:
            raise self.refusal(len(text), param)

    def refusal(self, chars: int, param: str) -> RequestTooLongError:
        """The refusal of a prompt (``param`` "prompt") or chat ("messages") of ``chars`` characters."""
        what = "the messages hold" if param == "messages" else "the prompt has"
        return RequestTooLongError(
            f"{what} {chars} characters, more than the {self.max_model_len}-token context can hold"
            f" (a token here covers at most {self.max_token_bytes} bytes)", param=param)


def tokens_per_message(tokenizer: Any) -> int:
    """The fewest tokens the chat template spends on one more (empty) message; 0 if unknown."""
    try:
        one = [{"role": "user", "content": ""}]
        texts = [tokenizer.apply_chat_template(one * n, add_generation_prompt=False) for n in (1, 2)]
        return max(0, len(tokenizer.encode(texts[1])) - len(tokenizer.encode(texts[0])))
    except Exception:  # noqa: BLE001 - a template that refuses two user turns in a row: no bound
        return 0


class PromptBuilder:
    """Render prompts on ``workers`` threads, tokenize long ones in a worker process; ``close()``
    stops both."""

    def __init__(self, tokenizer: Any, max_model_len: int, workers: int = DEFAULT_WORKERS,
                 processes: int = 1) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.bound = PromptLengthBound.of(tokenizer, max_model_len)
        if self.bound is not None:
            log.info("prompts over %d characters are refused before tokenizing", self.bound.max_chars)
        self.message_tokens = tokens_per_message(tokenizer) if hasattr(tokenizer, "apply_chat_template") else 0
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="chatfleet-tokenize")
        backend = getattr(tokenizer, "backend", None)
        self._processes = TokenizerProcesses(backend, processes) if backend is not None else None

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _check(self, text: str, param: str) -> None:
        if self.bound is not None:
            self.bound.check(text, param)

    def _check_messages(self, messages: list[ChatMessage]) -> None:
        """Refuse a chat that cannot fit before rendering it: too many messages, or too much text."""
        if self.message_tokens and len(messages) * self.message_tokens > self.max_model_len:
            raise self._too_many_messages(len(messages))
        if self.bound is not None:
            chars = 0
            for m in messages:
                if isinstance(m.content, str):
                    chars += len(m.content)
                elif m.content:
                    chars += sum(len(p.text or "") for p in m.content)
            if chars > self.bound.max_chars:
                raise self.bound.refusal(chars, "messages")

    async def _encode(self, text: str, param: str) -> list[int]:
        if self._processes is None:
            return await self._run(lambda: self.tokenizer.encode(text))
        ids = await self._processes.encode(text, self.max_model_len)
        if isinstance(ids, TooManyTokens):
            raise RequestTooLongError(
                f"the prompt has more than {int(ids)} tokens; the context holds {self.max_model_len}",
                param=param)
        return ids

    @property
    def judges_bodies(self) -> bool:
        """Large bodies can be judged in the tokenizing process (``parse_body``)."""
        return self._processes is not None

    async def parse_body(self, path: str, body: bytes | SharedBody) -> object:
        """A large body's JSON value, parsed, validated and measured in the tokenizing process
        (``large_bodies.py``): a body that is invalid or whose prompt cannot fit is refused there,
        with the message the route would give, and its text never reaches this process. A
        ``SharedBody`` is read by the worker from its memory file (no pickled copy here)."""
        assert self._processes is not None, "no tokenizing process (judges_bodies is false)"
        limits = BodyLimits(self.max_model_len, self.bound.max_chars if self.bound is not None else None,
                            self.max_model_len // self.message_tokens if self.message_tokens else None)
        processes = self._processes
        out = await offered_by_name(lambda sent: processes.run(judge_body, path, sent, limits), body)
        if isinstance(out, Refused):
            raise self._refusal(out)
        return out

    def _too_many_messages(self, n: int) -> RequestTooLongError:
        return RequestTooLongError(
            f"the chat has {n} messages; at {self.message_tokens} tokens each at least,"
            f" more than the {self.max_model_len}-token context holds", param="messages")

    def _refusal(self, refused: Refused) -> InvalidRequestError:
        if not refused.too_long:
            return InvalidRequestError(refused.message, param=refused.param)
        if refused.messages:
            return self._too_many_messages(refused.messages)
        if refused.chars and self.bound is not None:
            return self.bound.refusal(refused.chars, refused.param or "messages")
        what = "the messages hold" if refused.param == "messages" else "the prompt has"
        return RequestTooLongError(f"{what} more than {refused.tokens} tokens; the context holds {self.max_model_len}",
                                   param=refused.param)

    async def chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered chat (with ``tools`` for templates that render them)."""
        self._check_messages(messages)
        text = await self._run(lambda: render_chat(
            self.tokenizer, messages, add_generation_prompt, tools, check_text=self._check))
        return await self._encode(text, "messages")

    async def completion(self, prompt: str | list[int]) -> CompletionPrompt:
        """One completions prompt (a text or token ids) as ids and text."""
        if isinstance(prompt, str):
            self._check(prompt, "prompt")
            if prompt and self._processes is not None:
                return CompletionPrompt(await self._encode(prompt, "prompt"), prompt)
        return await self._run(lambda: completion_prompt(self.tokenizer, prompt))

    async def encode(self, text: str, param: str = "prompt") -> list[int]:
        self._check(text, param)
        return await self._encode(text, param)

    def start(self) -> None:
        """Start the tokenizing process (the server's start-up calls this)."""
        if self._processes is not None:
            self._processes.warm()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            self._processes.close()
