"""Prompts off the event loop: chat templates and tokenization run on a bounded pool of threads.

A 10 MB prompt takes seconds to tokenize; on the event loop that would stall every stream of the
server. ``PromptBuilder`` renders and encodes on ``workers`` threads (the ``tokenizers`` encoder
releases the GIL), and before encoding refuses a text whose length alone proves it longer than
the context: no token covers more than ``max_token_bytes`` bytes of text, so a text of more than
``max_model_len * max_token_bytes`` bytes (times a slack where a normalizer may shrink the text)
cannot fit.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from chatfleet.engine.api.serving import CompletionPrompt, chat_prompt_ids, completion_prompt
from chatfleet.errors import RequestTooLongError
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
            raise RequestTooLongError(
                f"the prompt has {len(text)} characters, more than the {self.max_model_len}-token"
                f" context can hold (a token here covers at most {self.max_token_bytes} bytes)",
                param=param,
            )


class PromptBuilder:
    """Render and tokenize prompts on ``workers`` threads; ``close()`` stops them."""

    def __init__(self, tokenizer: Any, max_model_len: int, workers: int = DEFAULT_WORKERS) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.tokenizer = tokenizer
        self.bound = PromptLengthBound.of(tokenizer, max_model_len)
        if self.bound is not None:
            log.info("prompts over %d characters are refused before tokenizing", self.bound.max_chars)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="chatfleet-tokenize")

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _check(self, text: str, param: str) -> None:
        if self.bound is not None:
            self.bound.check(text, param)

    async def chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered chat (with ``tools`` for templates that render them)."""
        return await self._run(lambda: chat_prompt_ids(
            self.tokenizer, messages, add_generation_prompt, tools, check_text=self._check))

    async def completion(self, prompt: str | list[int]) -> CompletionPrompt:
        """One completions prompt (a text or token ids) as ids and text."""
        if isinstance(prompt, str):
            self._check(prompt, "prompt")
        return await self._run(lambda: completion_prompt(self.tokenizer, prompt))

    async def encode(self, text: str, param: str = "prompt") -> list[int]:
        self._check(text, param)
        return await self._run(lambda: self.tokenizer.encode(text))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
