"""One engine replica in virtual time: the real ``Engine`` (scheduler, KV manager, policies,
``step()``) over a ``SimRunner`` whose step-cost model says how long each step takes.

``SimReplica.run()`` is the engine loop on a virtual-time loop (``plan/virtual_loop.py``): while
there is work each step runs at once and a timer at its end (its cost later) hands the step's
tokens to their requests, timestamped there, and runs the next step; a step that ends before
anything else on the loop can run skips the timer (the loop would jump straight to it). Plain
steps (decodes, admissions and prefill chunks of plain requests) run through the engine's
decode spans (``Engine.open_decode_span``, ``engine/decode_span.py``) with ``step()``'s own
effects. ``generate()`` submits one
request and fills its ``RequestRecord`` (TTFT, every inter-token gap, cached tokens) as a
measured run would. ``on_plan`` sees every ``SchedulerOutput`` (tests compare them).

Coarse time (``token_scale`` k > 1, see ``plan/cost_model.py``): a simulated token is k real
ones produced over the step's k real steps, so each gets ``cost / k``; the first real token of
a reply comes after the real steps the engine would need for the prompt's last chunk (its
tokens at the step's budget left by the decodes, at most k steps); token counts in the record
are real ones. What coarse time cannot show: arrivals wait for a k-times longer step to end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chatfleet.bench.records import RequestRecord
from chatfleet.engine.config import EngineConfig
from chatfleet.engine.decode_span import DecodeSpan, Lane
from chatfleet.engine.engine import Engine
from chatfleet.engine.outputs import RequestOutput, SchedulerOutput
from chatfleet.engine.request import Request, SamplingParams
from chatfleet.engine.runner.sim_runner import SimRunner
from chatfleet.errors import InvalidRequestError, ServerOverloadedError
from chatfleet.plan.session_hashes import SessionHashes
from chatfleet.plan.virtual_loop import VirtualClock

SIM_VOCAB = 1 << 30  # token ids of simulated traffic are arbitrary integers below this


class _NullDetokenizer:
    def add_tokens(self, token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


class NullTokenizer:
    """The engine's tokenizer seat for token-id traffic: no text, no stop strings, no EOS."""

    eos_token_id = None
    stop_token_ids = ()
    vocab_size = SIM_VOCAB

    def incremental_detokenizer(self, prompt_token_ids: list[int]) -> _NullDetokenizer:
        return _NullDetokenizer()


@dataclass
class _Pending:
    record: RequestRecord
    t0: float  # the run's start (records count from it)
    intended: float
    future: asyncio.Future
    session: str | None = None
    prefix_group: str | None = None
    request: Request | None = None  # the engine's, read when it finishes (its block hashes)
    tokens: list[int] = field(default_factory=list)
    last: float | None = None


class SimReplica:
    def __init__(self, name: str, config: EngineConfig, num_blocks: int, cost_model: Callable[[SchedulerOutput], float],
                 clock: VirtualClock, *, num_host_blocks: int = 0, fast: bool = True,
                 on_plan: Callable[[SchedulerOutput], None] | None = None, token_scale: int = 1,
                 decode_spans: bool = True) -> None:
        self.name = name
        self.token_scale = token_scale
        self.clock = clock
        self._cost_model = cost_model
        self._on_plan = on_plan
        self._step_cost = 0.0
        self._last_plan: SchedulerOutput | None = None
        max_len = config.max_model_len or 1 << 20
        self.runner = SimRunner(num_blocks, config.cache.block_size, vocab_size=SIM_VOCAB, max_model_len=max_len,
                                cost_model=self._charge, num_host_blocks=num_host_blocks, check_contents=not fast)
        self.engine = Engine(config, runner=self.runner, tokenizer=NullTokenizer(), clock=clock)
        self._pending: dict[str, _Pending] = {}
        self._histories = SessionHashes(config.cache.block_size)
        self._wake: asyncio.Event | None = None
        self._stepping: asyncio.Future | None = None  # run() waits on it while steps chain (``_step_now``)
        self._timer: asyncio.TimerHandle | None = None  # the running step's end
        self._closed = False
        self.busy_s = 0.0  # virtual seconds spent in steps
        # plain steps (decodes, prefills, admissions) run by the engine's decode spans: fast mode, exact time only
        self.decode_spans = decode_spans and fast and token_scale == 1
        self._decode_cost = getattr(cost_model, "decode_cost", None) if on_plan is None else None
        self._batch_cost = getattr(cost_model, "batch_cost", None) if on_plan is None else None
        self.span_steps = 0  # steps run inside decode spans
        self._span: DecodeSpan | None = None  # open across steps while they stay plain
        self._span_done = 0  # its steps that have ended (their records may be written)
        self._span_end = 0.0  # when the last of them ended

    def _charge(self, plan: SchedulerOutput) -> float:
        if self._on_plan is not None:
            self._on_plan(plan)
        self._step_cost = self._cost_model(plan)
        self._last_plan = plan
        return self._step_cost

    @property
    def load(self) -> int:
        return len(self._pending)

    async def generate(self, request_id: str, prompt: list[int], max_tokens: int, record: RequestRecord,
                       t0: float, intended: float, session: str | None = None,
                       prefix_group: str | None = None) -> list[int]:
        """Serve one request; returns its tokens (empty, with the record's status set, on refusal).
        ``prompt``: token ids below ``SIM_VOCAB`` (the engine is told so and does not check them).
        ``session``: the conversation, whose previous turn's block hashes this one reuses;
        ``prefix_group``: requests that start alike (a character's card), whose last one's block
        hashes a session's first turn reuses."""
        now = self.clock()
        record.sent_s = now - t0
        record.queue_s = max(0.0, now - intended)
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        try:
            self.engine.add_request(request_id, prompt, params, arrival_time=now, ids_in_vocab=True)
        except ServerOverloadedError as e:
            record.status, record.http_status, record.error = "error", 503, e.message
            return []
        except InvalidRequestError as e:
            record.status, record.http_status, record.error = "error", 400, e.message
            return []
        record.http_status = 200
        request = self.engine.get_request(request_id)
        if session is not None:
            self._histories.prime(session, request, prefix_group)
        fut = asyncio.get_running_loop().create_future()
        self._pending[request_id] = _Pending(record, t0, intended, fut, session, prefix_group, request)
        if self._wake is not None:
            self._wake.set()
        return await fut

    async def run(self) -> None:
        """The engine loop: step while there is work, each step taking its cost in virtual time.

        While there is work, steps chain through timer callbacks (``_step_now``, its end at
        ``start + cost``: deliver, then the next step at once), as a loop of ``await sleep(cost)``
        would run them, without a task wake-up per step; the coroutine waits until the work runs out.
        """
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        engine = self.engine
        try:
            while not self._closed:
                if not engine.has_unfinished_requests():
                    self._end_span()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._stepping = loop.create_future()
                self._step_now(loop)
                await self._stepping
        finally:
            if self._timer is not None:
                self._timer.cancel()
            self._end_span()

    def _step_now(self, loop: asyncio.AbstractEventLoop) -> None:
        """One step starting now; its end (a timer) delivers it and starts the next. A span step
        that ends before anything else can run (``VirtualTimeLoop.idle_before``) ends at once,
        the clock moved to its end, as the loop would do next; so do the steps after it."""
        idle_before = getattr(loop, "idle_before", None)
        try:
            while self.decode_spans:
                cost = self._span_step()
                if cost is None:
                    break
                start = self.clock()
                self.busy_s += cost
                end = start + cost
                if idle_before is None or not idle_before(end):
                    self._timer = loop.call_at(end, self._step_ended, loop, self._span_step_done, start, cost)
                    return
                self.clock.advance_to(end)
                self._span_step_done(start, cost)
                if not self._keep_stepping():
                    return
            self._step_cost = 0.0
            start = self.clock()
            outputs = self.engine.step()
            cost = self._step_cost
            self.busy_s += cost
            self._timer = loop.call_at(start + (cost if (outputs or cost > 0) else 1e-3),
                                       self._step_ended, loop, self._deliver, outputs, start, cost)
        except BaseException as e:  # noqa: BLE001 - to run(), as an exception inside its loop would be
            self._stop_stepping(e)

    def _step_ended(self, loop: asyncio.AbstractEventLoop, deliver: Callable[..., None], *args: Any) -> None:
        """A step's timer: deliver it (``_span_step_done`` or ``_deliver``), then the next step."""
        try:
            deliver(*args)
        except BaseException as e:  # noqa: BLE001 - handed to run()
            self._stop_stepping(e)
            return
        if self._keep_stepping():
            self._step_now(loop)

    def _keep_stepping(self) -> bool:
        """After a step ended: whether run() still wants steps (where the work ran out or the
        replica closed, its wait ends; where run() was cancelled, nothing more)."""
        self._timer = None
        stepping = self._stepping
        if stepping is None or stepping.done():  # run() was cancelled
            return False
        if self._closed or not self.engine.has_unfinished_requests():
            stepping.set_result(None)
            return False
        return True

    def _stop_stepping(self, error: BaseException) -> None:
        self._timer = None
        if self._stepping is not None and not self._stepping.done():
            self._stepping.set_exception(error)

    def _deliver(self, outputs: list[RequestOutput], start: float, cost: float) -> None:
        """Hand a step's tokens to their requests' records, now (the step's end)."""
        now = self.clock()
        k = self.token_scale
        part = cost / k if k > 1 else cost  # one real step of this simulated one
        firsts: dict[str, int] = {}
        if k > 1 and self._last_plan is not None:
            chunks = self._last_plan.chunks
            decodes = sum(1 for c in chunks if c.num_tokens == 1)
            left = max(1, self.engine.scheduler.step_budget(decodes) - decodes)
            firsts = {c.request_id: min(k, -(-c.num_tokens * k // left)) for c in chunks if c.sample}
        for out in outputs:
            p = self._pending.get(out.request_id)
            if p is None:
                continue
            rec = p.record
            n = len(out.new_token_ids)
            if n:
                if p.last is None:
                    first = start + part * firsts[out.request_id] if out.request_id in firsts else now
                    rec.first_token_s = first - p.t0
                    rec.ttft_s = first - p.intended
                    rec.itl_s.extend([0.0] * (n - 1) if k == 1 else [part] * (n * k - 1))
                elif k == 1 and n == 1:
                    rec.itl_s.append(cost if p.last == start else now - p.last)
                elif k == 1:
                    rec.itl_s.extend([cost if p.last == start else (now - p.last) / n] * n)
                else:
                    rec.itl_s.extend([part if p.last == start else (now - p.last) / (n * k)] * (n * k))
                p.last = now
                p.tokens.extend(out.new_token_ids)
            if out.finished:
                del self._pending[out.request_id]
                if p.session is not None:
                    self._histories.keep(p.session, p.request, p.prefix_group)
                rec.end_s = now - p.t0
                rec.reply_s = now - p.intended
                rec.output_tokens = len(p.tokens)
                rec.prompt_tokens = out.num_prompt_tokens * k
                rec.cached_tokens = out.num_cached_tokens * k
                if k > 1:  # the last simulated token may stand for fewer than k real ones
                    rec.output_tokens = min(len(p.tokens) * k, max(rec.expected_tokens, 1))
                    del rec.itl_s[max(0, rec.output_tokens - 1):]
                if out.finish_reason not in ("stop", "length"):
                    rec.status, rec.error = "error", f"finished with {out.finish_reason}"
                if not p.future.done():  # the caller may have left (drain timeout)
                    p.future.set_result(p.tokens)

    # ---- decode spans (engine/decode_span.py) --------------------------------------------------
    def _span_step(self) -> float | None:
        """Run the next step as the open span's (opening one where it can), or None (nothing
        done, the span committed) where it is not a plain decode step."""
        span = self._span
        if span is not None and not span.still_plain():
            self._end_span()
            span = None
        if span is None:
            span = self.engine.open_decode_span(self._decode_cost, self._charge, self._batch_cost, admits=True)
            if span is None:
                return None
            now = self.clock()
            for lane in span.lanes:  # each inter-token gap is then the step's cost, as in run()
                p = self._pending.get(lane.request.request_id)
                if p is not None and p.last != now:
                    return None
            self._span, self._span_done, self._span_end = span, 0, now
        cost = span.step()
        if cost is None:
            self._end_span()
            return None
        if not cost > 0:
            raise AssertionError("decode spans need positive step costs")
        return cost

    def _span_step_done(self, start: float, cost: float) -> None:
        """The span's last step ended now: the requests it finished get their records (the
        others' wait for the span's end: nothing reads them before)."""
        span = self._span
        assert span is not None
        for fin in span.finished:
            self._flush_lane(span, fin.lane, fin.step, start)
            self._deliver([fin.output], start, cost)
        if span.started:
            self._deliver(span.started, start, cost)
        self._span_done, self._span_end = span.num_steps, self.clock()

    def _flush_lane(self, span: DecodeSpan, lane: Lane, upto: int, end: float) -> None:
        """Put the span's steps before ``upto`` (the last ending at ``end``) on the lane's record."""
        if upto <= lane.delivered:
            return
        p = self._pending.get(lane.request.request_id)
        if p is not None:
            p.record.itl_s.extend(span.costs[lane.delivered:upto])
            p.tokens.extend(span.tokens(lane, lane.delivered, upto))
            p.last = end
        lane.delivered = upto

    def _end_span(self) -> None:
        """Commit the open span: its requests' state, and the records of its ended steps."""
        span = self._span
        if span is None:
            return
        self._span = None
        span.commit()
        for lane in span.lanes:
            if lane.alive:
                self._flush_lane(span, lane, self._span_done, self._span_end)
        self.span_steps += span.num_steps

    def close(self) -> None:
        self._closed = True
        if self._wake is not None:
            self._wake.set()
