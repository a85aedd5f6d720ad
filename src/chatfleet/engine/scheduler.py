"""The token-budget scheduler: plans each step, applies the runner's results.

There is no prefill or decode phase: every running request needs ``num_tokens -
num_computed_tokens`` more tokens computed (1 for a decode, more for a prompt or a recompute).
Each step, decodes go first, then unfinished prompts, then waiting requests (chunked prefill),
all under ``max_batched_tokens`` (``mixed_step_tokens`` where the step has decodes:
``step_budget``). When the pool is full, the policy's victim is preempted by recompute: its
blocks are freed and it returns to the front of the waiting queue.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from chatfleet.engine.config import SchedulerConfig
from chatfleet.engine.kv.base import KVManager
from chatfleet.engine.outputs import RequestUpdate, RunnerOutput, ScheduledChunk, SchedulerOutput, TokenLogprob
from chatfleet.engine.request import Request, RequestStatus
from chatfleet.engine.scheduling_policy import make_scheduling_policy
from chatfleet.errors import KVIntegrityError, ServerOverloadedError

MAX_SKIPS = 8  # candidates that did not fit, tried per step before admission stops


def _arrival(r: Request) -> float:
    return r.arrival_time


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVManager,
        *,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids  # the request's eos_token_id counts too
        self.waiting = make_scheduling_policy(config.policy, kv, config, clock)
        self.running: list[Request] = []  # sorted by arrival time
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unreported_finished(self) -> int:
        """Requests finished since the last plan (the next plan names them)."""
        return len(self._finished_ids)

    def add_request(self, request: Request) -> None:
        """Queue a request; the engine holds at most max_running + max_waiting at once.

        Requests added between two steps all sit in ``waiting`` until the next step schedules
        them, so free batch slots count as room too (else a burst admits only max_waiting)."""
        free_slots = max(0, self.config.max_running - len(self.running))
        if len(self.waiting) >= self.config.max_waiting + free_slots:
            raise ServerOverloadedError(
                f"the engine is full: {len(self.running)} running, {len(self.waiting)} waiting"
                f" (--max-running {self.config.max_running}, --max-waiting {self.config.max_waiting});"
                " retry later"
            )
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request now (abort, stop string, ...): free its blocks. None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request_id)
        request.status = status
        self._finished_ids.append(request_id)
        return request

    def take_finished_ids(self) -> list[str]:
        """The ids finished since the last plan, which the next plan names (and forgets)."""
        finished, self._finished_ids = self._finished_ids, []
        return finished

    def defer_finished(self, request_ids: list[str]) -> None:
        """Hand finished ids of a plan that was not executed to the next plan."""
        self._finished_ids[:0] = request_ids

    # ---- planning -----------------------------------------------------------------------------
    def step_budget(self, num_decodes: int) -> int:
        """The step's token budget with ``num_decodes`` decode rows in it: ``max_batched_tokens``,
        or where decodes run and ``mixed_step_tokens`` is set, that many (never fewer than the
        decodes, which always run; prompt chunks get what they leave)."""
        cfg = self.config
        if num_decodes == 0 or cfg.mixed_step_tokens is None:
            return cfg.max_batched_tokens
        return min(cfg.max_batched_tokens, max(cfg.mixed_step_tokens, num_decodes))

    def schedule(self) -> SchedulerOutput:
        chunks: list[ScheduledChunk] = []
        scheduled: set[str] = set()
        preempted: list[str] = []

        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        others = [r for r in self.running if r.num_tokens - r.num_computed_tokens != 1]
        budget = self.step_budget(len(decodes))
        for request in decodes + others:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv.allocate(request, n) is None:
                candidates = [r for r in self.running if r.request_id not in scheduled]
                victim = self.waiting.select_victim(candidates)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                chunks.append(self.chunk(request, n))
                scheduled.add(request.request_id)
                budget -= n

        if not preempted:
            budget = self.admit_waiting(budget, chunks)

        return SchedulerOutput(chunks, preempted, self.take_finished_ids(), self.kv.take_transfers())

    def admit_waiting(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        """Admit waiting requests in the policy's order while budget and memory last, appending
        their chunks; returns the budget left. A request that does not fit stops admission under a
        head-of-line policy, or when it is overdue; otherwise the next candidate may start (at
        most ``MAX_SKIPS`` tries per step). ``schedule`` calls it after the running requests'
        chunks (the planner's decode spans too, at the same point of a step)."""
        now = self.clock()
        limit = min(self.config.max_running - len(self.running), budget)
        skips = 0
        for request in self.waiting.candidates(now, limit):
            if budget <= 0 or len(self.running) >= self.config.max_running:
                break
            prefix = self.kv.match_prefix(request)
            n = request.num_tokens - prefix.num_tokens
            fits = True
            if n > budget and not self.config.enable_chunked_prefill and budget < self.config.max_batched_tokens:
                fits = False  # wait for a step of its own; alone it is chunked by necessity
            n = min(n, budget)
            if not fits or self.kv.allocate(request, n, prefix=prefix) is None:
                skips += 1
                if self.waiting.head_of_line or self.waiting.is_overdue(request, now) or skips >= MAX_SKIPS:
                    break
                continue
            self.waiting.pop(request)
            request.num_computed_tokens = prefix.num_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = prefix.num_tokens
                request.first_scheduled_time = now
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_arrival)
            chunks.append(self.chunk(request, n))
            budget -= n
        return budget

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)

    def chunk(self, request: Request, n: int) -> ScheduledChunk:
        """The chunk of a running request's next ``n`` tokens (its KV blocks already allocated)."""
        start = request.num_computed_tokens
        end = start + n
        p = request.num_prompt_tokens
        if start >= p:
            tokens = request.output_token_ids[start - p : end - p]
        elif end <= p:
            tokens = request.prompt_token_ids[start:end]
        else:
            tokens = request.prompt_token_ids[start:] + request.output_token_ids[: end - p]
        params = request.sampling_params
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=tokens,
            start_position=start,
            block_table=self.kv.block_ids(request.request_id),
            sample=end == request.num_tokens,
            sampling_params=params,
            num_output_tokens=request.num_output_tokens,
            eos_token_id=request.eos_token_id,
            want_prompt_logprobs=(
                params.prompt_logprobs is not None and request.num_output_tokens == 0
            ),
            group_block_tables=self.kv.group_block_ids(request.request_id),
            **self._token_history(request, sample=end == request.num_tokens),
        )

    @staticmethod
    def _token_history(request: Request, sample: bool) -> dict[str, tuple[int, ...]]:
        """Prompt and output tokens for penalties, only where the sampler reads them."""
        if not (sample and request.sampling_params.uses_token_history):
            return {}
        return {"prompt_token_ids": tuple(request.prompt_token_ids),
                "output_token_ids": tuple(request.output_token_ids)}

    # ---- applying results ---------------------------------------------------------------------
    def update(self, plan: SchedulerOutput, result: RunnerOutput) -> list[RequestUpdate]:
        if plan.kv_transfers:
            self.kv.finish_transfers()
        updates: list[RequestUpdate] = []
        for chunk in plan.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += chunk.num_tokens
            self.kv.cache_computed(request)
            prompt_lp = result.prompt_logprobs.get(chunk.request_id) if chunk.want_prompt_logprobs else None
            if not chunk.sample:
                if prompt_lp is not None:
                    updates.append(RequestUpdate(
                        request.request_id, [], request.status, request.num_prompt_tokens,
                        max(request.num_cached_tokens, 0), len(request.output_token_ids),
                        None, prompt_lp, chunk.start_position == 0,
                    ))
                continue
            sampled = result.sampled[chunk.request_id]
            logprobs = [sampled.logprob] if sampled.logprob is not None else None
            updates.append(self.sampled_update(
                request, sampled.token_id, logprobs, prompt_lp, chunk.want_prompt_logprobs and chunk.start_position == 0
            ))
        return updates

    def sampled_update(self, request: Request, token_id: int, logprobs: list[TokenLogprob] | None = None,
                       prompt_logprobs: list[TokenLogprob] | None = None, restart: bool = False) -> RequestUpdate:
        """Apply a token sampled for a running request whose KV is now computed: append it,
        check the stop (which may finish the request), and say so as a value."""
        outputs = request.output_token_ids
        outputs.append(token_id)
        stop_reason = self.check_stop(request, token_id)
        num_outputs = len(outputs)
        queue_time = None
        if num_outputs == 1 and request.first_scheduled_time is not None:
            queue_time = request.first_scheduled_time - request.arrival_time
        return RequestUpdate(
            request.request_id, [token_id], request.status, len(request.prompt_token_ids),
            max(request.num_cached_tokens, 0), num_outputs, logprobs, prompt_logprobs, restart, stop_reason,
            queue_time,
        )

    def check_stop(self, request: Request, token_id: int) -> int | None:
        """Finish the request if this token ends it; return the stop token id when one did."""
        params = request.sampling_params
        status = None
        stop_reason = None
        if request.num_output_tokens >= params.min_tokens:
            is_eos = token_id == request.eos_token_id or token_id in self.eos_token_ids
            if is_eos and not params.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif token_id in params.stop_token_ids:
                status, stop_reason = RequestStatus.FINISHED_STOPPED, token_id
        if status is None and (
            request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.finish_request(request.request_id, status)
        return stop_reason

    # ---- checks -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """KV invariants, plus: every request is running xor waiting, and KV covers its work."""
        self.kv.check_integrity()
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        ids = running_ids + waiting_ids
        if len(set(ids)) != len(ids) or set(ids) != set(self.requests):
            raise KVIntegrityError(f"scheduler: running {running_ids} + waiting {waiting_ids} != known")
        if len(self.running) > self.config.max_running:
            raise KVIntegrityError("scheduler: more running requests than max_running")
        if set(self.kv.request_ids) - set(running_ids):
            raise KVIntegrityError("scheduler: a request that is not running holds KV blocks")
        for r in self.running:
            if r.status != RequestStatus.RUNNING:
                raise KVIntegrityError(f"scheduler: {r.request_id} is in running with {r.status!r}")
            if self.kv.num_blocks_of(r.request_id) * self.kv.block_size < r.num_computed_tokens:
                raise KVIntegrityError(f"scheduler: {r.request_id} has fewer blocks than computed tokens")
            if not 0 <= r.num_computed_tokens < r.num_tokens:
                raise KVIntegrityError(f"scheduler: {r.request_id} computed {r.num_computed_tokens}/{r.num_tokens}")
        for r in self.waiting:
            if r.num_computed_tokens != 0 or r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise KVIntegrityError(f"scheduler: waiting {r.request_id} is {r.status!r}")
        if any(self.running[i].arrival_time > self.running[i + 1].arrival_time for i in range(len(self.running) - 1)):
            raise KVIntegrityError("scheduler: running list out of arrival order")
