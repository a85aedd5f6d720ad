"""The Engine: admission, then one schedule / execute / update round per ``step()``.

The scheduler plans (which requests, how many tokens, which KV blocks), the runner executes the
plan on tensors, the scheduler applies the results and the output processor turns them into
``RequestOutput``s. Its parts (runner, KV manager, context length) come from
``engine/builder.py``. The planner runs many plain steps at once through ``open_decode_span``
(``engine/decode_span.py``), with exactly ``step()``'s effects. Not thread-safe: one thread
drives it (``AsyncEngine`` does).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from chatfleet.engine.builder import EngineParts, build_engine_parts
from chatfleet.engine.config import EngineConfig
from chatfleet.engine.decode_span import BatchCost, DecodeCost, DecodeSpan
from chatfleet.engine.kv.base import KVManager
from chatfleet.engine.kv.spec import KVCacheSpec, PoolPlan
from chatfleet.engine.output_processor import OutputProcessor
from chatfleet.engine.outputs import RequestOutput, RunnerOutput, SchedulerOutput
from chatfleet.engine.request import Request, RequestStatus, SamplingParams
from chatfleet.engine.runner.base import Runner
from chatfleet.engine.scheduler import Scheduler
from chatfleet.engine.sizing.memory import MemoryBreakdown
from chatfleet.engine.stats import EngineStats, OutputCounts, TransferTotals
from chatfleet.engine.structured.compiler import GrammarCompiler, GrammarError
from chatfleet.engine.structured.matchers import StructuredOutputs
from chatfleet.errors import InvalidRequestError, KVIntegrityError, RequestTooLongError


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        runner: Runner | None = None,
        tokenizer: Any = None,
        clock: Callable[[], float] = time.monotonic,
        parts: EngineParts | None = None,
    ) -> None:
        """An engine of ``parts``, or of the parts ``build_engine_parts`` makes of the config (the
        model loaded, unless ``runner`` and ``tokenizer`` are given)."""
        if parts is None:
            parts = build_engine_parts(config, runner=runner, tokenizer=tokenizer, clock=clock)
        self.config = config
        self.clock = clock
        self.runner: Runner = parts.runner
        self.tokenizer: Any = parts.tokenizer
        self.kv: KVManager = parts.kv
        self.kv_spec: KVCacheSpec | None = parts.kv_spec  # None for an injected runner
        self.pool_plan: PoolPlan | None = parts.pool_plan
        self.memory: MemoryBreakdown | None = parts.memory
        self.model_name = config.served_model_name or config.model
        self.max_model_len: int = parts.max_model_len
        self.vocab_size: int = parts.vocab_size
        eos = getattr(self.tokenizer, "stop_token_ids", ()) or ()
        self.scheduler = Scheduler(
            parts.scheduler_config, self.kv, max_model_len=self.max_model_len, eos_token_ids=frozenset(eos),
            clock=clock,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._transfers = TransferTotals()
        self._counts = OutputCounts()
        # Structured output (response_format, forced tool calls): a tokenizer with a `tokenizers`
        # backend is needed to build grammars' token masks; None: constrained requests are refused.
        backend = getattr(self.tokenizer, "backend", None)
        self.structured: StructuredOutputs | None = None if backend is None else StructuredOutputs(
            GrammarCompiler(backend.to_str(), self.vocab_size, getattr(self.tokenizer, "eos_token_id", None)))

    # ---- requests -----------------------------------------------------------------------------
    @property
    def max_request_tokens(self) -> int:
        """The most prompt + max_tokens one request may ask for (context and KV pool bound)."""
        return min(self.max_model_len, self.kv.total_tokens)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
        ids_in_vocab: bool = False,
    ) -> None:
        """Queue a request. ``ids_in_vocab``: the caller made every prompt id itself within
        ``0..vocab_size - 1`` (the planner's token-id traffic), so the O(prompt) range check,
        a tenth of a simulated request's cost, is skipped; clients' ids are always checked."""
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if not ids_in_vocab and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size):
            bad = next(t for t in prompt_token_ids if not 0 <= t < self.vocab_size)
            raise InvalidRequestError(
                f"token id {bad} is out of the vocabulary (0..{self.vocab_size - 1})", param="prompt"
            )
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total}"
                f" exceeds the model's context length of {self.max_model_len} tokens",
                param="max_tokens",
            )
        if total > self.kv.total_tokens:
            raise RequestTooLongError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total}"
                f" exceeds the KV cache of {self.kv.total_tokens} tokens",
                param="max_tokens",
            )
        matcher = None
        if params.grammar is not None:
            if self.structured is None:
                raise InvalidRequestError("this engine's tokenizer cannot build grammars for structured output",
                                          param="response_format")
            try:
                matcher = self.structured.matcher(params.grammar)
            except GrammarError as exc:
                raise InvalidRequestError(f"the grammar cannot be compiled: {exc}", param="response_format") from None
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            eos_token_id=getattr(self.tokenizer, "eos_token_id", None),
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
            session_id=session_id,
        )
        self.scheduler.add_request(request)
        self.output_processor.add_request(request_id, request.prompt_token_ids, params)
        if matcher is not None:
            assert self.structured is not None
            self.structured.add(request_id, matcher)

    def abort_request(self, request_id: str) -> None:
        """Finish the request now and free its blocks; no-op if unknown or finished."""
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.output_processor.remove_request(request_id)
        if self.structured is not None:
            self.structured.remove((request_id,))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        structured = self.structured if self.structured is not None and len(self.structured) else None
        if plan.is_empty:
            self.scheduler.defer_finished(plan.finished_request_ids)
            return []
        mask = None
        if structured is not None:  # the batch's token bitmask, filled in one pass
            mask = structured.bitmask([c.request_id for c in plan.chunks if c.sample])
            if mask is not None:
                plan = dataclasses.replace(plan, token_bitmask=mask)
        result: RunnerOutput = self.runner.execute(plan)
        if structured is not None and mask is not None:
            structured.accept((rid, result.sampled[rid].token_id) for rid in mask.request_ids if rid in result.sampled)
        if plan.kv_transfers:
            self._transfers.add(result.kv_transfer)
        updates = self.scheduler.update(plan, result)
        processed = self.output_processor.process(updates)
        for hit in processed.stopped:
            self.scheduler.finish_request(hit.request_id, RequestStatus.FINISHED_STOPPED)
        if structured is not None:  # finished requests drop their matchers now (ids may be reused)
            structured.remove([o.request_id for o in processed.outputs if o.finished]
                              + [hit.request_id for hit in processed.stopped])
        self._counts.count(processed.outputs)
        return processed.outputs

    def open_decode_span(
        self,
        decode_cost: DecodeCost | None,
        charge: Callable[[SchedulerOutput], float] | None,
        batch_cost: BatchCost | None = None,
        admits: bool = False,
    ) -> DecodeSpan | None:
        """Many plain steps run at once, with exactly ``step()``'s effects (the planner's fast
        path, ``engine/decode_span.py``); None where the next step is not plain. The runner must
        be a ``SimRunner`` in fast mode. ``admits``: every request added is plain (a forced
        length, no logprobs, penalties or stop strings), so the span's steps may admit them."""
        return DecodeSpan.open(self.scheduler, self.kv, self.runner, self.output_processor, self._counts,
                               decode_cost, charge, batch_cost, admits)

    # ---- memory and stats ---------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def stats(self) -> EngineStats:
        """The engine's counters and gauges now (the KV manager's ``stats()`` value built here)."""
        kv, counts, t = self.kv.stats(), self._counts, self._transfers
        host = kv.host
        tiered = host is not None
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=kv.usage,
            num_blocks=kv.num_blocks,
            block_size=kv.block_size,
            num_cached_blocks=kv.num_cached_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_evictions=kv.num_evictions,
            prompt_tokens=counts.prompt_tokens,
            generation_tokens=counts.generation_tokens,
            num_finished=counts.num_finished,
            host_num_blocks=host.num_blocks if host is not None else None,
            host_num_cached_blocks=host.num_cached_blocks if host is not None else None,
            host_cache_queries=kv.host_cache_queries if tiered else None,
            host_cache_hits=kv.host_cache_hits if tiered else None,
            host_promotions=host.promotions if host is not None else None,
            host_demotions=host.demotions if host is not None else None,
            host_demotions_skipped=host.demotions_skipped if host is not None else None,
            host_demotions_dropped=host.demotions_dropped if host is not None else None,
            host_evictions=host.evictions if host is not None else None,
            kv_bytes_loaded=t.bytes_loaded if tiered else None,
            kv_bytes_stored=t.bytes_stored if tiered else None,
            kv_seconds_loading=t.seconds_loading if tiered else None,
            kv_seconds_storing=t.seconds_storing if tiered else None,
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        if self.output_processor.num_requests != len(self.scheduler.requests):
            raise KVIntegrityError(
                f"engine: {self.output_processor.num_requests} detokenizing requests but"
                f" {len(self.scheduler.requests)} scheduled"
            )

    def get_request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id)
