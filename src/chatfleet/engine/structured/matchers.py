"""Per-request grammar state of an engine, and the batch's token bitmask each step.

``StructuredOutputs.add`` gives a request its matcher; each step ``bitmask(ids)`` fills the rows
of the constrained requests that sample, in one pass over the batch (llguidance's executor runs
the matchers in parallel with the GIL released); ``accept`` advances a matcher by the token the
sampler picked; ``remove`` drops finished requests. A token the grammar refuses (a client's
``logit_bias`` or ``min_tokens`` can force one) ends that request's constraint, logged once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence

import llguidance
import llguidance.numpy as llnp

from chatfleet.engine.structured.bitmask import TokenBitmask
from chatfleet.engine.structured.compiler import GrammarCompiler
from chatfleet.engine.structured.spec import GrammarSpec

log = logging.getLogger(__name__)


def default_mask_threads() -> int:
    """Threads that fill a step's masks: half the cores, at most 8 (the rest run the model; on a
    2-core machine more threads than one only take time from the forward pass)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class StructuredOutputs:
    def __init__(self, compiler: GrammarCompiler, threads: int | None = None) -> None:
        self.compiler = compiler
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._threads = threads or default_mask_threads()
        self._executor: llguidance.LLExecutor | None = None  # made on first use (it starts threads)

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher of ``spec`` (compiled inline unless cached); GrammarError if it cannot compile."""
        return self.compiler.compile(spec).matcher()

    def add(self, request_id: str, matcher: llguidance.LLMatcher) -> None:
        """Constrain ``request_id`` by ``matcher`` from now on."""
        self._matchers[request_id] = matcher

    def remove(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)

    def bitmask(self, request_ids: Sequence[str]) -> TokenBitmask | None:
        """Allowed next tokens of the constrained ones among ``request_ids`` (None: none of them)."""
        rows = [(rid, m) for rid in request_ids if (m := self._matchers.get(rid)) is not None]
        if not rows:
            return None
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._threads)
        bits = llnp.allocate_token_bitmask(len(rows), self.compiler.vocab_size)
        llnp.fill_next_token_bitmask_par(self._executor, [(m, i) for i, (_, m) in enumerate(rows)], bits)
        return TokenBitmask(tuple(rid for rid, _ in rows), bits)

    def accept(self, tokens: Iterable[tuple[str, int]]) -> None:
        """Advance each constrained request's matcher by its sampled token."""
        for rid, token_id in tokens:
            m = self._matchers.get(rid)
            if m is None:
                continue
            if not m.consume_token(token_id):
                log.warning("request %s: token %d is outside its grammar (%s); it is no longer constrained",
                            rid, token_id, _first_error_line(m.get_error()))
                del self._matchers[rid]


def _first_error_line(error: str) -> str:
    """llguidance's error text dumps its parser state; the line that says what went wrong."""
    lines = error.strip().splitlines() or [""]
    return next((line for line in lines if "Error" in line), lines[0])[:200]
