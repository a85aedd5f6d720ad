"""The Engine: admission, then one schedule / execute / update round per ``step()``.

The scheduler plans (which requests, how many tokens, which KV blocks), the runner executes the
plan on tensors, the scheduler applies the results and the output processor turns them into
``RequestOutput``s. Not thread-safe: one thread drives it (``AsyncEngine`` does).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from chatfleet.engine.config import EngineConfig, engine_memory
from chatfleet.engine.kv.hybrid import HybridKVManager
from chatfleet.engine.kv.manager import KVManager
from chatfleet.engine.kv.spec import KVCacheSpec, PoolPlan
from chatfleet.engine.memory_check import check_kv_fits
from chatfleet.engine.output_processor import OutputProcessor
from chatfleet.engine.outputs import RequestOutput, RunnerOutput
from chatfleet.engine.request import Request, RequestStatus, SamplingParams
from chatfleet.engine.scheduler import Scheduler
from chatfleet.engine.stats import EngineStats, TransferTotals
from chatfleet.errors import ConfigError, InvalidRequestError, KVIntegrityError, RequestTooLongError
from chatfleet.engine.sizing.memory import MemoryBreakdown
from chatfleet.engine.sizing.config_readers import has_config_reader

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        runner: Any = None,
        tokenizer: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        model_max_len = None
        self.kv_spec: KVCacheSpec | None = None  # None for an injected runner that gave none
        self.pool_plan: PoolPlan | None = None
        self.memory: MemoryBreakdown | None = None  # weights by class, KV per token, pool (plan/memory.py)
        vocab_size = getattr(runner, "vocab_size", None)
        if runner is None:
            from chatfleet.engine.runner.torch_runner import TorchRunner

            loaded = self._load_model(config)
            if has_config_reader(loaded.hf_config):
                memory = engine_memory(config, loaded.hf_config)
                self.memory, self.kv_spec, self.pool_plan = memory, memory.kv_spec, memory.pool
                log.info("%s", memory.describe())
            else:  # a model type the memory arithmetic does not know yet: the model's own spec
                self.kv_spec = loaded.config.kv_cache_spec(config.cache.block_size, config.resolved_kv_cache_dtype)
                self.pool_plan = config.cache.plan_pools(self.kv_spec)
                log.info("%s", self.pool_plan.describe())
            num_blocks: int | dict[str, int] = self.pool_plan.pools[0].num_blocks
            if len(self.kv_spec.groups) > 1:  # a pool per layer group (kv/hybrid.py)
                if config.cache.host_memory_bytes:
                    raise ConfigError("the host cache tier is not supported for models with several KV layer groups")
                num_blocks = {p.group.name: p.num_blocks for p in self.pool_plan.pools}
                log.info("%s", self.pool_plan.describe())
            host_plan = config.cache.plan_host_pools(self.kv_spec)
            num_host_blocks = host_plan.pools[0].num_blocks if host_plan is not None else 0
            if host_plan is not None:
                log.info("host tier: %s", host_plan.describe())
            check_kv_fits(self.pool_plan.num_bytes, host_plan.num_bytes if host_plan else 0, config.device)
            runner = TorchRunner(loaded, num_blocks, config.cache.block_size, config.device, seed=config.seed,
                                 num_host_blocks=num_host_blocks, kv_cache_dtype=config.kv_cache_dtype,
                                 kv_scales_from_prompts=config.kv_scales_from_prompts)
            tokenizer = tokenizer or loaded.tokenizer
            model_max_len = loaded.max_model_len
            vocab_size = loaded.config.vocab_size
        elif tokenizer is None:
            raise ConfigError("an Engine given a runner needs a tokenizer too")
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = config.served_model_name or config.model
        model_max_len = model_max_len or getattr(runner, "max_model_len", None)
        if config.max_model_len is not None:
            if model_max_len is not None and config.max_model_len > model_max_len:
                raise ConfigError(
                    f"max_model_len {config.max_model_len} exceeds the model's {model_max_len}"
                )
            model_max_len = config.max_model_len
        if model_max_len is None:
            raise ConfigError("cannot tell the model's context length; set max_model_len")
        block_size = getattr(runner, "block_size", config.cache.block_size)
        if block_size != config.cache.block_size:
            raise ConfigError(f"runner block size {block_size} != configured {config.cache.block_size}")
        if config.max_model_len is None:
            # Unless asked otherwise, serve no longer a request than the pool can ever hold.
            model_max_len = min(model_max_len, runner.num_blocks * block_size)
        self.max_model_len: int = model_max_len
        self.vocab_size: int = vocab_size or tokenizer.vocab_size
        scheduler_config = config.scheduler
        if self.pool_plan is not None and len(self.pool_plan.pools) > 1:
            self.kv: KVManager | HybridKVManager = HybridKVManager(
                self.pool_plan,
                enable_prefix_caching=config.cache.enable_prefix_caching,
                eviction_policy=config.cache.eviction_policy,
                keep_slid_out_blocks=config.cache.keep_slid_out_blocks,
                clock=clock,
            )
            fit = self.kv.max_step_tokens()
            if fit < scheduler_config.max_batched_tokens:
                log.warning("max_batched_tokens %d -> %d: what the sliding-window KV pool holds in one step",
                            scheduler_config.max_batched_tokens, fit)
                scheduler_config = replace(scheduler_config, max_batched_tokens=fit)
        else:
            self.kv = KVManager(
                runner.num_blocks,
                block_size,
                enable_prefix_caching=config.cache.enable_prefix_caching,
                eviction_policy=config.cache.eviction_policy,
                num_host_blocks=getattr(runner, "num_host_blocks", 0),
                host_eviction_policy=config.cache.host_eviction_policy,
                clock=clock,
            )
        eos = getattr(tokenizer, "stop_token_ids", ()) or ()
        self.scheduler = Scheduler(
            scheduler_config, self.kv, max_model_len=self.max_model_len, eos_token_ids=frozenset(eos),
            clock=clock,
        )
        self._transfers = TransferTotals()
        self.output_processor = OutputProcessor(tokenizer)
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._num_finished = 0

    @staticmethod
    def _load_model(config: EngineConfig) -> Any:
        from chatfleet.engine.models.loader import load_model
        from chatfleet.models.tiny import resolve_model

        if config.num_threads is not None:
            import torch

            torch.set_num_threads(config.num_threads)
        return load_model(resolve_model(config.model), dtype=config.dtype, device=config.device,
                          kernels=config.kernels, quantization=config.quantization,
                          embedding_dtype=config.embedding_dtype,
                          language_model_only=config.language_model_only)

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
        self.output_processor.add_request(request)

    def abort_request(self, request_id: str) -> None:
        """Finish the request now and free its blocks; no-op if unknown or finished."""
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.output_processor.remove_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self.scheduler.defer_finished(plan.finished_request_ids)
            return []
        result: RunnerOutput = self.runner.execute(plan)
        if plan.kv_transfers:
            self._transfers.add(result.kv_transfer)
        updates = self.scheduler.update(plan, result)
        processed = self.output_processor.process(updates)
        for hit in processed.stopped:
            self.scheduler.finish_request(hit.request_id, RequestStatus.FINISHED_STOPPED)
        self.note_outputs(processed.outputs)
        return processed.outputs

    def note_outputs(self, outputs: list[RequestOutput]) -> None:
        """Count a step's outputs in the engine's stats (``step()``, and the planner's steps run
        outside it: ``plan/decode_span.py``)."""
        for out in outputs:
            self._generation_tokens += len(out.new_token_ids)
            if out.num_output_tokens == len(out.new_token_ids):
                self._prompt_tokens += out.num_prompt_tokens  # first output of the request
            if out.finished:
                self._num_finished += 1

    def count_generated(self, num_tokens: int) -> None:
        """Output tokens produced outside ``step()`` (the planner's many-steps-at-once decode)."""
        self._generation_tokens += num_tokens

    # ---- memory and stats ---------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def stats(self) -> EngineStats:
        pc = self.kv.prefix_cache
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=self.kv.usage,
            num_blocks=self.kv.num_blocks,
            block_size=self.kv.block_size,
            num_cached_blocks=self.kv.pool.num_cached_blocks,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_evictions=self.kv.pool.num_evictions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_finished=self._num_finished,
            **self._host_stats(),
        )

    def _host_stats(self) -> dict[str, int | float]:
        host = self.kv.host
        if host is None:
            return {}
        pc, t = self.kv.prefix_cache, self._transfers
        return dict(
            host_num_blocks=host.pool.num_blocks,
            host_num_cached_blocks=host.pool.num_cached_blocks,
            host_cache_queries=pc.host_queries,
            host_cache_hits=pc.host_hits,
            host_promotions=host.promotions,
            host_demotions=host.demotions,
            host_demotions_skipped=host.demotions_skipped,
            host_demotions_dropped=host.demotions_dropped,
            host_evictions=host.evictions,
            kv_bytes_loaded=t.bytes_loaded,
            kv_bytes_stored=t.bytes_stored,
            kv_seconds_loading=t.seconds_loading,
            kv_seconds_storing=t.seconds_storing,
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
