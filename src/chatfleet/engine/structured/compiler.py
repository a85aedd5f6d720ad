"""Grammars compiled off the step loop, cached by spec.

``GrammarCompiler.compile_async(spec)`` compiles on a small thread pool (llguidance builds the
grammar with the GIL released), so the server awaits it without stalling the engine thread or
the event loop; requests for the same spec share one compilation, and the result (or the error)
stays cached (LRU, ``cache_size`` specs). ``compile(spec)`` is the same, inline, for callers
without a loop (a cache hit when the server compiled it first). Each request then gets its own
matcher, a copy of the compiled one's initial state.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

from chatfleet.engine.structured.spec import GrammarSpec

DEFAULT_WORKERS = 2
DEFAULT_CACHE_SIZE = 512
# Compact JSON: no free whitespace between tokens (a model cannot pad a reply forever with it).
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The grammar library cannot compile a spec; the message says why, in its words."""


class CompiledGrammar:
    """A compiled grammar; ``matcher()`` is a fresh matcher for one request."""

    def __init__(self, spec: GrammarSpec, template: llguidance.LLMatcher) -> None:
        self.spec = spec
        self._template = template

    def matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for ``spec``; GrammarError where the spec is not even well formed."""
    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


class GrammarCompiler:
    """Compiles specs for one tokenizer (its ``tokenizers`` JSON, vocabulary size and EOS id)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None, *,
                 workers: int = DEFAULT_WORKERS, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if workers < 1 or cache_size < 1:
            raise ValueError("workers and cache_size must be >= 1")
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = eos_token_id
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="chatfleet-grammar")
        self.num_compiled = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                         eos_token=self._eos)
            return self._tokenizer

    def _build(self, spec: GrammarSpec) -> CompiledGrammar:
        grammar = grammar_text(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        self.num_compiled += 1
        return CompiledGrammar(spec, matcher)

    def _future(self, spec: GrammarSpec, inline: bool) -> Future[CompiledGrammar]:
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                return fut
            if inline:
                fut = Future()
            else:
                fut = self._pool.submit(self._build, spec)
            self._cache[spec] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        if inline:
            try:
                fut.set_result(self._build(spec))
            except GrammarError as exc:
                fut.set_exception(exc)
        return fut

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar (inline on a cache miss); GrammarError if it cannot compile."""
        return self._future(spec, inline=True).result()

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """The compiled grammar as a future, compiled on the pool on a cache miss (the engine core
        waits for a request's grammar this way, off its step loop)."""
        return self._future(spec, inline=False)

    async def compile_async(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar, compiled on the pool on a cache miss; GrammarError as above."""
        return await asyncio.wrap_future(self.submit(spec))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
