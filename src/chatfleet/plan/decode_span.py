"""Many decode-only engine steps at once, with exactly the effects of stepping them one by one.

Between two arrivals most steps of a chat workload are alike: every running request computes
one token, nothing waits, nothing finishes, and new blocks come from the free list. The plan of
such a step is known without asking the scheduler (a one-token chunk per running request, in the
running order), so a ``DecodeSpan`` applies several of them in one go, in the engine's own order
of effects: each step's allocations (``KVManager.allocate``, running order), the sampled tokens
(the fast runner's ``fast_token``), each filled block's registration (``KVManager.cache_computed``);
then the requests' token lists, the engine's and runner's counters and the replica's records.
Nothing else can happen in between: a span starts only where the scheduler itself would plan
exactly that step (nothing waiting, no finished ids to report, every running request one token
behind, forced lengths, no logprobs or penalties), and it ends before the first step that
would finish a request, evict a cached block (a host-tier copy), or start at or after any other
timer of the event loop (an arrival). The step costs are the cost model's own: its O(1)
``decode_cost`` when it has one, else ``charge(plan)`` on the plan built here (and ``on_plan``
sees each plan, so tests compare them with the engine's).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from chatfleet.engine.engine import Engine
from chatfleet.engine.kv.manager import KVManager
from chatfleet.engine.outputs import ScheduledChunk, SchedulerOutput
from chatfleet.engine.request import Request
from chatfleet.engine.runner.sim_runner import SimRunner

_ALLOCATE, _REGISTER = 0, 1  # a step's effects in this order (schedule, then update)


@dataclass
class Lane:
    """One running request in a span."""

    request: Request
    start: int  # its computed tokens when the span began
    outputs: int  # its output tokens when the span began
    last_token: int  # the token the span's first step computes
    finish_step: int  # the span step in which it would finish (never run here)
    tokens: list[int] = field(default_factory=list)  # sampled in the span so far
    committed: int = 0  # of ``tokens``, already on the request


class DecodeSpan:
    """Start with ``open`` (None where the next step is not a plain decode step), then ``step``
    while it returns a cost, ``commit`` to write the effects onto the requests."""

    def __init__(self, engine: Engine, runner: SimRunner, lanes: list[Lane],
                 decode_cost: Callable[[int, int], float | None] | None,
                 charge: Callable[[SchedulerOutput], float] | None) -> None:
        self.engine, self.runner, self.lanes = engine, runner, lanes
        self.kv = engine.kv
        self.block_size = self.kv.block_size
        self._decode_cost = decode_cost
        self._charge = charge  # builds plans (tests' on_plan, cost models without decode_cost)
        self.sum_starts = sum(lane.start for lane in lanes)
        self.horizon = min(lane.finish_step for lane in lanes)
        self.costs: list[float] = []
        self._counted = 0  # steps already added to the engine's and runner's counters
        self._events: list[tuple[int, int, int]] = []
        bs = self.block_size
        for i, lane in enumerate(lanes):
            nblocks = self.kv.num_blocks_of(lane.request.request_id)
            self._events.append((nblocks * bs - lane.start, _ALLOCATE, i))  # computes position nblocks * bs
            self._events.append(((-(lane.start + 1)) % bs, _REGISTER, i))  # fills a block
        heapq.heapify(self._events)

    @classmethod
    def open(cls, engine: Engine, runner: SimRunner, decode_cost: Callable[[int, int], float | None] | None,
             charge: Callable[[SchedulerOutput], float] | None) -> DecodeSpan | None:
        s = engine.scheduler
        running = s.running
        if (not running or len(s.waiting) or s.num_unreported_finished or type(engine.kv) is not KVManager
                or runner.check_contents or len(running) > s.config.max_batched_tokens):
            return None
        lanes = []
        for r in running:
            p = r.sampling_params
            if (r.num_tokens - r.num_computed_tokens != 1 or p.min_tokens < p.max_tokens or p.logprobs is not None
                    or p.prompt_logprobs is not None or p.uses_token_history):
                return None
            outputs = len(r.output_token_ids)
            finish = min(p.max_tokens - outputs, s.max_model_len - r.num_tokens) - 1
            if finish <= 0:
                return None  # it finishes in the next step
            last = r.output_token_ids[-1] if outputs else r.prompt_token_ids[-1]
            lanes.append(Lane(r, r.num_computed_tokens, outputs, last, finish))
        return cls(engine, runner, lanes, decode_cost, charge)

    @property
    def num_steps(self) -> int:
        return len(self.costs)

    def still_plain(self) -> bool:
        """After other code ran: is the next step still this span's (nothing added or ended)?"""
        s = self.engine.scheduler
        return (not len(s.waiting) and not s.num_unreported_finished and len(s.running) == len(self.lanes)
                and all(r is lane.request for r, lane in zip(s.running, self.lanes)))

    def step(self) -> float | None:
        """Run the next step and return its cost, or None (nothing done) where it is not plain:
        a request would finish, or the free list cannot supply its blocks without an eviction."""
        j = len(self.costs)
        if j >= self.horizon:
            return None
        events = self._events
        needed = 0
        for when, kind, _ in events:  # a heap: entries of step j are among the smallest
            if when == j and kind == _ALLOCATE:
                needed += 1
        if needed > self.kv.pool.num_empty_blocks:
            return None
        bs = self.block_size
        lanes = self.lanes
        while events and events[0][0] == j and events[0][1] == _ALLOCATE:
            _, _, i = heapq.heappop(events)
            lane = lanes[i]
            self._sync(lane, j, lane.start + j)  # while scheduling step j
            if self.kv.allocate(lane.request, 1) is None:
                raise AssertionError("decode span: a counted free block was not there")
            heapq.heappush(events, (j + bs, _ALLOCATE, i))
        runner = self.runner
        for lane in lanes:
            r = lane.request
            lane.tokens.append(runner.fast_token(r.request_id, lane.start + j + 1, r.eos_token_id,
                                                 r.sampling_params.stop_token_ids))
        cost = self._decode_cost(len(lanes), self.sum_starts + len(lanes) * j) if self._decode_cost else None
        if cost is None:
            assert self._charge is not None
            cost = self._charge(self._plan(j))
        while events and events[0][0] == j:  # registrations (allocations of step j are done)
            _, _, i = heapq.heappop(events)
            lane = lanes[i]
            self._sync(lane, j, lane.start + j + 1)  # in update, before its token is appended
            self.kv.cache_computed(lane.request)
            heapq.heappush(events, (j + bs, _REGISTER, i))
        self.costs.append(cost)
        return cost

    def _sync(self, lane: Lane, sampled: int, computed: int) -> None:
        """Put the request where the engine has it mid-step: the span's first ``sampled`` tokens
        on its list, ``computed`` tokens with KV."""
        r = lane.request
        if sampled > lane.committed:
            r.output_token_ids.extend(lane.tokens[lane.committed:sampled])
            lane.committed = sampled
        r.num_computed_tokens = computed

    def _plan(self, j: int) -> SchedulerOutput:
        """The plan the scheduler would make for step ``j`` (blocks as allocated above)."""
        chunks = []
        for lane in self.lanes:
            r = lane.request
            token = lane.tokens[j - 1] if j else lane.last_token
            chunks.append(ScheduledChunk(
                request_id=r.request_id, token_ids=[token], start_position=lane.start + j,
                block_table=self.kv.block_ids(r.request_id), sample=True, sampling_params=r.sampling_params,
                num_output_tokens=lane.outputs + j, eos_token_id=r.eos_token_id, want_prompt_logprobs=False,
                group_block_tables=self.kv.group_block_ids(r.request_id)))
        return SchedulerOutput(chunks, [], [], [])

    def commit(self) -> None:
        """Write every step run so far onto the requests and the engine's and runner's counters
        (idempotent: only what is new since the last commit)."""
        n = len(self.costs)
        for lane in self.lanes:
            r = lane.request
            if lane.committed < n:
                r.output_token_ids.extend(lane.tokens[lane.committed:n])
                lane.committed = n
            r.num_computed_tokens = lane.start + n
        new = self.costs[self._counted:]
        self.engine.count_generated(len(new) * len(self.lanes))
        self.runner.note_steps(new)
        self._counted = n
