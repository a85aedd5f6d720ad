"""Plain engine steps run many at once (the planner's fast path), with exactly ``step()``'s effects.

Most steps of a chat workload are alike: every running request computes one token and nothing
waits. The plan of such a step is known without asking the scheduler (a one-token chunk per
running request, in the running order), so a ``DecodeSpan`` (``Engine.open_decode_span``) runs
it directly beside the scheduler, in ``schedule``/``update``'s own order of effects: the step's
allocations (``KVManager.allocate``, running order), then per request in that order its filled
block's registration (``KVManager.cache_computed``) and, for a request that reaches its length,
the scheduler's own ``sampled_update`` (append, stop check), the output processor and the
engine's output counts. Everything else (tokens on the requests, the engine's and runner's
counters) is written only at ``commit``, so a step costs O(1) plus the few requests that fill a
block or finish in it.

A span stays open across steps: its owner (``plan/sim_replica.py``) calls ``step`` once per
engine step, each at the step's own time on the event loop (other coroutines and replicas run in
between exactly as before), checking ``still_plain()`` first (nothing added, aborted or waiting that it cannot
admit), and ``commit``s before anything else reads the requests (the scheduler's next real step).
A span starts only where the scheduler itself would plan exactly that step: every running
request a lane (one token behind) or, where the owner says all its requests are plain, mid-prefill;
all with a forced length, no logprobs, penalties or stop strings. A step is refused (None) where
its blocks are not there (the engine would preempt): without a host tier a block may come from
evicting a cached one (``allocate`` does it, at the step's time); with one, only from
the empty list (an eviction would be a transfer in the plan).

Prefills run inside the span's steps too (without a host tier, plain requests only), in
``schedule``'s order: after the decodes' allocations, the chunks of requests mid-prefill (running
order, ``Scheduler.chunk``, the budget the decodes leave), then the scheduler's own
``admit_waiting`` with the budget left, exactly where ``schedule`` calls it. After the decodes'
updates each such chunk gets the engine's update (register its computed blocks; where it ends
the prompt, sample, check the stop, process the output for ``started``). A request that then
decodes joins as a lane from the next step if it follows every lane in the running order (the
decodes' order in a plan; else the span ends after the step). Under head-of-line FCFS a step
skips admission where it provably admits nothing (``_head_blocked``), so a long queue costs
nothing per step. Lanes that finished are dropped as others join: a span may last the hour.

The step costs are the cost model's own: its O(1) ``decode_cost`` (``batch_cost`` with prefill
chunks) when it has one, else ``charge(plan)`` on the plan built here (``tests/plan/test_simulator.py``
compares those plans with the engine's; ``tests/engine/test_decode_span.py`` the records of runs
with spans on and off). A span runs only over the single-pool KV manager (``PagedKVManager``)
and a ``SimRunner`` in fast mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from chatfleet.engine.kv.base import KVManager
from chatfleet.engine.kv.manager import PagedKVManager
from chatfleet.engine.output_processor import OutputProcessor
from chatfleet.engine.outputs import RequestOutput, ScheduledChunk, SchedulerOutput
from chatfleet.engine.request import Request, RequestStatus
from chatfleet.engine.runner.base import Runner
from chatfleet.engine.runner.sim_runner import SimRunner
from chatfleet.engine.scheduler import Scheduler
from chatfleet.engine.scheduling_policy import FCFSPolicy
from chatfleet.engine.stats import OutputCounts

__all__ = ["BatchCost", "DecodeCost", "DecodeSpan", "Finish", "Lane"]

DecodeCost = Callable[[int, int], "float | None"]  # StepCostModel.decode_cost: (decodes, sum of positions)
BatchCost = Callable[[int, int, Sequence[tuple[int, int]]], "float | None"]  # StepCostModel.batch_cost


@dataclass(eq=False, slots=True)
class Lane:
    """One running request in a span."""

    index: int  # its place in the running order
    request: Request
    start: int  # step j computes position start + j (its computed tokens at step 0)
    outputs: int  # its output tokens at step 0 (so ``outputs + j`` at step j)
    last_token: int  # the token its first step computes
    finish_step: int  # the span step that samples its last token
    first_step: int = 0  # the step it joined at (> 0: admitted by the span's step first_step - 1)
    tokens: list[int] = field(default_factory=list)  # sampled at steps first_step, ... (filled on demand)
    committed: int = 0  # steps whose tokens are on the request (from first_step)
    delivered: int = 0  # steps whose tokens went to the span's owner (its records)
    alive: bool = True

    def __post_init__(self) -> None:
        self.committed = self.delivered = self.first_step


@dataclass(frozen=True)
class Finish:
    """A lane whose last token the step sampled, and the engine's output for it."""

    lane: Lane
    step: int
    output: RequestOutput


class DecodeSpan:
    """``Engine.open_decode_span`` (None where the next step is not a plain decode step), then per
    engine step: ``still_plain()`` and ``step()`` (its cost, or None: not plain); ``commit`` at
    the end. It counts its outputs in the engine's ``OutputCounts`` and its steps on the runner."""

    def __init__(self, scheduler: Scheduler, kv: PagedKVManager, runner: SimRunner,
                 output_processor: OutputProcessor, counts: OutputCounts, lanes: list[Lane],
                 decode_cost: DecodeCost | None, charge: Callable[[SchedulerOutput], float] | None,
                 batch_cost: BatchCost | None = None, admits: bool = False,
                 prefilling: list[Request] | None = None) -> None:
        self.runner, self.lanes = runner, lanes  # dead ones dropped as lanes join
        self._next_index = len(lanes)  # a joining lane's place in the running order (a sort key)
        self._prefilling = prefilling or []  # running requests mid-prefill (running order): chunks of their own
        self.scheduler = scheduler
        self.kv = kv
        self._output_processor = output_processor
        self._counts = counts
        self.block_size = kv.block_size
        self._decode_cost = decode_cost
        self._batch_cost = batch_cost
        self._charge = charge  # builds plans (tests' on_plan, cost models without decode_cost)
        self._evicts = not kv.has_host_tier  # an eviction without a host tier is no transfer
        self._tests_head = _tests_head(scheduler, kv)  # may skip admission while requests wait (``_head_blocked``)
        self._admits = admits and self._evicts  # runs the scheduler's admission in its steps
        self._plain = True  # False once a step leaves a request the next step cannot run as a lane
        self.costs: list[float] = []
        self.finished: list[Finish] = []  # lanes that finished in the last step
        self.started: list[RequestOutput] = []  # first outputs of the requests the last step admitted
        self._running = list(self.scheduler.running)  # the scheduler's running list, as it must be
        self._unreported = self.scheduler.num_unreported_finished  # finished ids the next plan names
        self._num_alive = len(lanes)
        self._sum_positions = sum(lane.start for lane in lanes)  # of the alive lanes, at the next step
        self._generated = 0  # output tokens of the steps so far, less the finishing ones
        self._counted_tokens = self._counted_steps = 0  # already added to the engine's / runner's counters
        self._allocations: dict[int, list[Lane]] = {}  # step -> lanes that need a block, running order
        self._events: dict[int, list[Lane]] = {}  # step -> lanes that fill a block or finish in it
        for lane in lanes:
            self._track(lane)

    def _track(self, lane: Lane) -> None:
        """File the lane's first block allocation, block fill and finish under their steps."""
        bs = self.block_size
        nblocks = self.kv.num_blocks_of(lane.request.request_id)
        self._allocations.setdefault(nblocks * bs - lane.start, []).append(lane)  # computes position nblocks * bs
        fill = lane.first_step + (-(lane.start + lane.first_step + 1)) % bs  # fills a block
        self._events.setdefault(fill, []).append(lane)
        if (lane.finish_step - fill) % bs:
            self._events.setdefault(lane.finish_step, []).append(lane)

    @classmethod
    def open(cls, scheduler: Scheduler, kv: KVManager, runner: Runner, output_processor: OutputProcessor,
             counts: OutputCounts, decode_cost: DecodeCost | None, charge: Callable[[SchedulerOutput], float] | None,
             batch_cost: BatchCost | None = None, admits: bool = False) -> DecodeSpan | None:
        """A span from the scheduler's state now (nothing changed), or None where its next step
        is not a plain decode step. ``admits``: the caller's requests are all plain (forced
        length, no logprobs, penalties or stop strings), so the span's steps may admit them."""
        s = scheduler
        running = s.running
        if (not running or type(kv) is not PagedKVManager or not isinstance(runner, SimRunner)
                or runner.check_contents or len(running) > s.config.max_batched_tokens):
            return None
        admits = admits and not kv.has_host_tier
        if len(s.waiting) and not admits and not _tests_head(s, kv):
            return None
        lanes: list[Lane] = []
        prefilling: list[Request] = []
        for r in running:
            lane = _lane(len(lanes), r, 0, s.max_model_len)
            if lane is not None:
                lanes.append(lane)
            elif admits and r.num_tokens - r.num_computed_tokens > 1 and _plain(r):
                prefilling.append(r)
            else:
                return None
        return cls(s, kv, runner, output_processor, counts, lanes, decode_cost, charge, batch_cost, admits,
                   prefilling)

    @property
    def num_steps(self) -> int:
        return len(self.costs)

    def still_plain(self) -> bool:
        """After other code ran: is the next step still this span's (nothing added, aborted or
        waiting that the span cannot admit)?"""
        s = self.scheduler
        return (self._plain and (not len(s.waiting) or self._tests_head or self._admits)
                and s.num_unreported_finished == self._unreported and s.running == self._running)

    def step(self) -> float | None:
        """Run the next step and return its cost, or None (nothing done) where the free list
        cannot supply its blocks; ``finished`` then names the lanes that finished in it, and
        ``started`` the first outputs of the requests whose prompt it completed."""
        j = len(self.costs)
        s, kv = self.scheduler, self.kv
        n = self._num_alive
        budget = s.step_budget(n) - n  # after the decodes, as schedule() counts it
        if budget < 0:
            return None
        allocations = self._allocations.get(j)
        needed = 0
        if allocations is not None:
            needed = sum(1 for lane in allocations if lane.alive)
        continuing: list[tuple[Request, int]] = []  # schedule()'s "others": prefills, running order
        for r in self._prefilling:
            if budget == 0:
                break
            k = min(r.num_tokens - r.num_computed_tokens, budget)
            needed += kv.new_blocks_needed(r, k)
            continuing.append((r, k))
            budget -= k
        if needed:
            if needed > (kv.num_free_blocks if self._evicts else kv.num_empty_blocks):
                return None  # the engine would preempt (or, with a host tier, may transfer)
        admitting = False
        if len(s.waiting) and not (self._tests_head and self._head_blocked(needed, budget)):
            if not self._admits:
                return None
            admitting = True
        finished_ids = s.take_finished_ids() if self._unreported else []
        if finished_ids:
            self.runner.forget(finished_ids)
        self._unreported = 0
        self.finished = []
        self.started = []
        if allocations is not None:
            del self._allocations[j]
            allocations.sort(key=_index)  # schedule()'s order: running order (a joined lane may precede)
            later = self._allocations.setdefault(j + self.block_size, [])
            for lane in allocations:
                if lane.alive:
                    lane.request.num_computed_tokens = lane.start + j  # while scheduling step j
                    if kv.allocate(lane.request, 1) is None:
                        raise AssertionError("decode span: a counted free block was not there")
                    later.append(lane)
        chunks: list[ScheduledChunk] = []  # besides the decodes: prefills, then admitted requests
        for r, k in continuing:
            if kv.allocate(r, k) is None:
                raise AssertionError("decode span: a counted free block was not there")
            chunks.append(s.chunk(r, k))
        if admitting:  # the scheduler's own admission, where schedule() runs it
            s.admit_waiting(budget, chunks)
        cost = None
        if not chunks and self._decode_cost is not None:
            cost = self._decode_cost(n, self._sum_positions)
        elif chunks and self._batch_cost is not None:
            cost = self._batch_cost(n, self._sum_positions, [(c.start_position, c.num_tokens) for c in chunks])
        if cost is None:
            assert self._charge is not None
            cost = self._charge(self._plan(j, finished_ids, chunks))
        self.costs.append(cost)
        self._sum_positions += n
        self._generated += n
        events = self._events.pop(j, None)
        if events is not None:
            events.sort(key=_index)  # the update's order: running order
            later = self._events.setdefault(j + self.block_size, [])
            for lane in events:
                if not lane.alive:
                    continue
                if lane.finish_step == j:
                    self._finish(lane, j)
                else:
                    self._sync(lane, j, lane.start + j + 1)  # in update, before its token is appended
                    kv.cache_computed(lane.request)
                    later.append(lane)
        if chunks:
            sampled = [r for r in (self._start(c) for c in chunks) if r is not None]  # the update's order
            self._join(sampled, j)
            self._running = list(s.running)
        return cost

    def _start(self, chunk: ScheduledChunk) -> Request | None:
        """The engine's update of a prefill chunk (of a request mid-prefill or just admitted): its
        computed blocks registered; where it ends the prompt, its first token sampled, the stop
        checked and the output processed (for ``started``). Returns the request where it now
        decodes (sampled and not finished)."""
        s = self.scheduler
        r = s.requests[chunk.request_id]
        if not _plain(r):
            raise AssertionError(f"decode span: a prefill of {r.request_id}, which is not plain")
        r.num_computed_tokens += chunk.num_tokens
        self.kv.cache_computed(r)
        if not chunk.sample:
            return None
        token = self.runner.fast_token(r.request_id, chunk.context_length, r.eos_token_id,
                                       r.sampling_params.stop_token_ids)
        self.started.append(self._sampled(r, token))
        if r.is_finished:
            self._unreported += 1
            return None
        return r

    def _join(self, sampled: list[Request], j: int) -> None:
        """Requests that decode from step ``j + 1`` on become lanes where they follow every lane in
        the running order (the decodes' order in a plan); otherwise the span ends after this step.
        The rest of the running requests that are not lanes are mid-prefill."""
        s = self.scheduler
        self.lanes = [lane for lane in self.lanes if lane.alive]  # a span may outlive thousands of requests
        lane_of = {id(lane.request): lane for lane in self.lanes}
        if sampled:
            position = {id(r): i for i, r in enumerate(s.running)}
            last = max((position[id(lane.request)] for lane in self.lanes), default=-1)
            for r in sorted(sampled, key=lambda r: position[id(r)]):
                lane = _lane(self._next_index, r, j + 1, s.max_model_len) if position[id(r)] > last else None
                if lane is None:
                    self._plain = False
                    return
                last = position[id(r)]
                self._next_index += 1
                self.lanes.append(lane)
                lane_of[id(r)] = lane
                self._track(lane)
                self._num_alive += 1
                self._sum_positions += lane.start + j + 1
        self._prefilling = [r for r in s.running if id(r) not in lane_of]

    def _head_blocked(self, num_allocated: int, budget: int) -> bool:
        """Whether the scheduler's admission, after this step's ``num_allocated`` blocks and with
        ``budget`` tokens left, certainly admits nothing (so the step need not try). Under
        head-of-line FCFS it tries only the head: it is blocked when the budget or the batch is
        full, or when the head's blocks (``KVManager.free_blocks_needed`` of its prefix match)
        exceed the free blocks left and this step's blocks evict none of its matched blocks
        (LRU's order says which they evict), so the match it gets then is the one tested here."""
        s, kv = self.scheduler, self.kv
        cfg = s.config
        if budget <= 0 or len(s.running) >= cfg.max_running:
            return True
        waiting = s.waiting
        assert isinstance(waiting, FCFSPolicy)  # ``_tests_head``
        head = waiting.peek()
        assert head is not None  # called while requests wait
        num_free = kv.num_free_blocks
        if -(-head.num_tokens // kv.block_size) <= num_free - num_allocated:
            return False  # fits even without a prefix hit: no need to match it
        prefix = kv.match_prefix(head)
        n = head.num_tokens - prefix.num_tokens
        if n > budget and not cfg.enable_chunked_prefill and budget < cfg.max_batched_tokens:
            return True
        if kv.free_blocks_needed(head, min(n, budget), prefix) <= num_free - num_allocated:
            return False
        evictions = num_allocated - kv.num_empty_blocks
        if evictions > 0 and prefix.blocks:
            victims = kv.next_evicted(evictions)
            if victims is None:
                return False
            matched = {id(b) for b in prefix.blocks}
            if any(id(b) in matched for b in victims):
                return False
        return True

    def _finish(self, lane: Lane, j: int) -> None:
        """The engine's update of a request's last step: register, append, check the stop (which
        finishes it), process the output; the span drops the lane."""
        r = lane.request
        self._sync(lane, j, lane.start + j)
        r.num_computed_tokens += 1
        self.kv.cache_computed(r)
        output = self._sampled(r, self.tokens(lane, j, j + 1)[0])
        lane.committed = j + 1
        if r.status != RequestStatus.FINISHED_LENGTH:
            raise AssertionError(f"decode span: {r.request_id} did not finish by length where it must")
        lane.alive = False
        self._num_alive -= 1
        self._sum_positions -= lane.start + j + 1
        self._generated -= 1  # counted with its output (``_sampled``)
        self._unreported += 1
        self._running = list(self.scheduler.running)
        self.finished.append(Finish(lane, j, output))

    def _sampled(self, r: Request, token: int) -> RequestOutput:
        """The engine's update of a sampled token: the scheduler's ``sampled_update`` (append it,
        check the stop), the output processed (a span has no stop strings) and counted."""
        processed = self._output_processor.process([self.scheduler.sampled_update(r, token)])
        if processed.stopped or len(processed.outputs) != 1:
            raise AssertionError("decode span: a stop string in a span")
        self._counts.count(processed.outputs)
        return processed.outputs[0]

    def tokens(self, lane: Lane, a: int, b: int) -> list[int]:
        """The tokens the lane samples at steps ``a`` to ``b - 1`` (``first_step <= a``, ``b`` at most
        the steps run), as the fast runner samples them."""
        base = lane.first_step
        have = base + len(lane.tokens)
        if have < b:
            r = lane.request
            lane.tokens.extend(self.runner.fast_tokens(r.request_id, lane.start + have + 1, b - have,
                                                       r.eos_token_id, r.sampling_params.stop_token_ids))
        return lane.tokens[a - base:b - base]

    def _sync(self, lane: Lane, sampled: int, computed: int) -> None:
        """Put the request where the engine has it mid-step: the span's first ``sampled`` tokens
        on its list, ``computed`` tokens with KV."""
        r = lane.request
        if sampled > lane.committed:
            r.output_token_ids.extend(self.tokens(lane, lane.committed, sampled))
            lane.committed = sampled
        r.num_computed_tokens = computed

    def _plan(self, j: int, finished_ids: list[str], admitted: list[ScheduledChunk]) -> SchedulerOutput:
        """The plan the scheduler would make for step ``j`` (blocks as allocated above)."""
        chunks = []
        for lane in self.lanes:
            if not lane.alive:
                continue
            r = lane.request
            token = self.tokens(lane, j - 1, j)[0] if j > lane.first_step else lane.last_token
            chunks.append(ScheduledChunk(
                request_id=r.request_id, token_ids=[token], start_position=lane.start + j,
                block_table=self.kv.block_ids(r.request_id), sample=True, sampling_params=r.sampling_params,
                num_output_tokens=lane.outputs + j, eos_token_id=r.eos_token_id, want_prompt_logprobs=False,
                group_block_tables=self.kv.group_block_ids(r.request_id)))
        return SchedulerOutput(chunks + admitted, [], finished_ids, [])

    def commit(self) -> None:
        """Write every step run so far onto the alive lanes' requests and the engine's and
        runner's counters (idempotent: only what is new since the last commit)."""
        n = len(self.costs)
        for lane in self.lanes:
            if lane.alive:
                self._sync(lane, n, lane.start + n)
        self._counts.generation_tokens += self._generated - self._counted_tokens
        self._counted_tokens = self._generated
        self.runner.note_steps(self.costs[self._counted_steps:])
        self._counted_steps = n


def _tests_head(scheduler: Scheduler, kv: KVManager) -> bool:
    """Whether a span can tell that waiting requests stay waiting: head-of-line FCFS admission,
    and a device pool alone (no host tier: its hits and demotions are transfers)."""
    waiting = scheduler.waiting
    return getattr(waiting, "name", None) == "fcfs" and waiting.head_of_line and not kv.has_host_tier


def _plain(r: Request) -> bool:
    """A forced length, no logprobs, penalties or stop strings: the engine's update of its steps
    is what a span runs."""
    p = r.sampling_params
    return not (p.min_tokens < p.max_tokens or p.logprobs is not None or p.prompt_logprobs is not None or p.stop
                or p.uses_token_history or p.grammar is not None)


def _lane(index: int, r: Request, step: int, max_len: int) -> Lane | None:
    """The request as a lane from span step ``step`` (one token behind, a forced length, no
    logprobs, penalties or stop strings), or None where its steps are not plain decodes."""
    p = r.sampling_params
    outputs = len(r.output_token_ids)
    num_tokens = len(r.prompt_token_ids) + outputs
    if num_tokens - r.num_computed_tokens != 1 or not outputs or not _plain(r):
        return None
    finish = min(p.max_tokens - outputs, max_len - num_tokens) - 1
    if finish < 0:
        return None
    return Lane(index, r, r.num_computed_tokens - step, outputs - step, r.output_token_ids[-1], step + finish,
                first_step=step)


def _index(lane: Lane) -> int:
    return lane.index
