"""Load: closed loop of N live chats, open loop of Poisson-arriving chats, fixed concurrency.

Every mode is bounded in time (warmup + duration, then a drain timeout) and optionally in
requests, seeded, and stops by itself. Requests whose intended send time falls in the warmup
are marked and left out of the stats.
"""

from __future__ import annotations

import asyncio
import gc
import random
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from chatfleet.bench.client import ClientConfig, send_chat
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.transport import Session, Transport
from chatfleet.bench.workload import Conversation, Workload
from chatfleet.errors import ConfigError

MODES = {
    "closed": "live chats held constant (a finished chat is replaced)",
    "open": "new chats arrive as a Poisson process, in chats per second",
    "concurrency": "requests in flight held constant, no think time (as other tools measure)",
}
HISTORY = ("live", "trace")
JOINS = {
    "start": "every chat is sent from its first turn",
    "steady": "closed loop: each slot's first chat is joined at a turn drawn uniformly from its turns, "
              "its earlier turns sent as scripted history (a fleet in steady state has chats at every "
              "stage; starting all at turn 0 measures a cold start of short prompts); measured once "
              "every joined history is computed and the queue it left has drained",
}


@dataclass(frozen=True)
class LoadSpec:
    mode: str
    level: float  # chats (closed), new chats per second (open), requests in flight (concurrency)
    duration_s: float = 30.0  # measured window after the warmup
    warmup_s: float = 5.0
    max_requests: int | None = None
    drain_timeout_s: float = 60.0
    history: str = "live"  # 'live': the server's replies; 'trace': the scripted/imported ones
    max_live_chats: int = 20000  # open-loop bound
    join: str = "start"  # where a closed-loop slot's first chat begins (JOINS)
    # steady join: the warmup lasts until every joined chat's first turn is answered (the server
    # has computed each live history once) and the requests then in flight have finished (the
    # join's backlog has drained), at most this many seconds past ``warmup_s``
    join_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown load mode {self.mode!r}; valid: {', '.join(MODES)}")
        if self.level <= 0:
            raise ConfigError(f"load level must be positive, got {self.level}")
        if self.mode != "open" and self.level != int(self.level):
            raise ConfigError(f"{self.mode} load needs a whole number, got {self.level}")
        if self.duration_s <= 0 or self.warmup_s < 0 or self.drain_timeout_s < 0:
            raise ConfigError("duration must be > 0 and warmup, drain timeout >= 0")
        if self.max_requests is not None and self.max_requests < 1:
            raise ConfigError("max_requests must be >= 1")
        if self.history not in HISTORY:
            raise ConfigError(f"unknown history mode {self.history!r}; valid: {', '.join(HISTORY)}")
        if self.join not in JOINS:
            raise ConfigError(f"unknown join {self.join!r}; valid: {', '.join(JOINS)}")
        if self.join_wait_s < 0:
            raise ConfigError("join_wait_s must be >= 0")
        if self.join != "start" and self.mode != "closed":
            raise ConfigError(f"join {self.join!r} applies to the closed loop only, not {self.mode!r}")


@dataclass
class LoadResult:
    spec: LoadSpec
    seed: int
    t0_ns: int
    started_unix: float
    window_s: float
    records: list[RequestRecord] = field(default_factory=list)
    conversations: int = 0


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + 256 if hard == resource.RLIM_INFINITY else min(hard, needed + 256)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class _Run:
    def __init__(self, workload: Workload, transport: Transport, cfg: ClientConfig, spec: LoadSpec, seed: int,
                 on_record: Callable[[RequestRecord], None] | None) -> None:
        self.w, self.t, self.cfg, self.spec, self.seed = workload, transport, cfg, spec, seed
        self.on_record = on_record
        self.rng = random.Random(f"load:{seed}")
        self.records: list[RequestRecord] = []
        self.next_conv = 0
        self.sent = 0
        self.t0 = time.perf_counter_ns()
        self.warm_end = self.t0 + int(spec.warmup_s * 1e9)
        self.end = self.warm_end + int(spec.duration_s * 1e9)
        self.idle_sessions: list[Session] = []
        # Steady join: the window opens once every slot's joined first turn is answered (or at
        # the latest ``join_wait_s`` after the warmup); until then every request is warmup.
        self.window_open = spec.join != "steady"
        self._joined_slots: set[int] = set()
        self._in_flight: set[int] = set()  # id() of each request sent and not yet answered
        self._backlog: set[int] | None = None  # those in flight when the last joined chat was answered
        self.latest_warm_end = self.warm_end + int(spec.join_wait_s * 1e9)
        if not self.window_open:
            self.end = self.latest_warm_end + int(spec.duration_s * 1e9)

    def open_window(self) -> None:
        """Start the measured window now (not before the warmup's end, not after its latest)."""
        if self.window_open:
            return
        self.window_open = True
        self.warm_end = min(max(self.warm_end, time.perf_counter_ns()), self.latest_warm_end)
        self.end = self.warm_end + int(self.spec.duration_s * 1e9)

    def joined(self, slot: int) -> None:
        """The slot's joined chat got (or failed, or never sent) its first turn. With the last
        slot's, the window opens once the requests in flight at that moment have finished: the
        histories' first computation leaves a queue behind it (every joined chat sends its whole
        history at once, a cold start no fleet in steady state sees), and a window opened before
        it drains measures that queue, not the load. A load the server cannot carry builds a new
        queue meanwhile, which the window then measures."""
        self._joined_slots.add(slot)
        if len(self._joined_slots) == int(self.spec.level) and self._backlog is None:
            self._backlog = set(self._in_flight)
            if not self._backlog:
                self.open_window()

    def _answered(self, rec: RequestRecord) -> None:
        self._in_flight.discard(id(rec))
        if self._backlog:
            self._backlog.discard(id(rec))
            if not self._backlog:
                self.open_window()

    def new_conversation(self) -> Conversation:
        i = self.next_conv
        self.next_conv += 1
        return self.w.conversation(i)

    def may_send(self, at_ns: int) -> bool:
        if at_ns >= self.end:
            return False
        return self.spec.max_requests is None or self.sent < self.spec.max_requests

    async def chat(self, conv: Conversation, session: Session, slot: int, start_ns: int, think: bool,
                   first_turn: int = 0, joining: bool = False) -> None:
        """Run one conversation; its turn ``first_turn`` is intended at ``start_ns`` (earlier turns,
        if any, are sent as the workload's scripted history). ``joining``: a slot's joined chat,
        which reports its first turn's end (or that it never sent one) to the window."""
        replies: list[str] = self.w.scripted_history(conv, first_turn)
        try:
            intended = start_ns
            for ti in range(first_turn, len(conv.turns)):
                turn = conv.turns[ti]
                if ti > first_turn:
                    intended += int(turn.think_time_s * 1e9) if think else 0
                if not self.may_send(intended):
                    return
                delay = (intended - time.perf_counter_ns()) / 1e9
                if delay > 0:
                    await asyncio.sleep(delay)
                    if not self.may_send(intended):  # another chat used the last request meanwhile
                        return
                self.sent += 1
                rec = RequestRecord(conv.conv_id, ti, conv.character_id, slot, 0.0,
                                    expected_tokens=turn.reply_tokens,
                                    warmup=not self.window_open or intended < self.warm_end,
                                    pause_s=(turn.think_time_s if think else 0.0) if ti > first_turn else None,
                                    session_id=f"bench-{self.seed}-{conv.conv_id}")
                self.records.append(rec)
                history = replies if self.spec.history == "live" else None
                self._in_flight.add(id(rec))
                try:
                    res = await send_chat(session, self.cfg, rec, conv.messages(ti, history), self.t0, intended)
                finally:
                    self._answered(rec)
                if self.on_record is not None:
                    self.on_record(rec)
                if joining and ti == first_turn:
                    self.joined(slot)
                if rec.status != "ok":
                    return  # the user leaves; the slot starts a new chat
                replies.append(res.text)
                intended = self.t0 + int((rec.end_s or 0.0) * 1e9)
        finally:
            if joining:  # also where it never sent its first turn (joined() is idempotent)
                self.joined(slot)

    async def slot_loop(self, slot: int, first_start: int, think: bool) -> None:
        session = self.t.session()
        start = first_start
        joining = self.spec.join == "steady"
        try:
            while self.may_send(start):
                conv = self.new_conversation()
                first_turn = self.w.join_turn(conv) if joining else 0
                await self.chat(conv, session, slot, start, think, first_turn, joining)
                joining = False  # later chats of the slot are new users: from their first turn
                now = time.perf_counter_ns()
                start = now + (int(self.w.first_think_time(conv.conv_id) * 1e9) if think else 0)
        finally:
            await session.discard()

    async def open_loop(self) -> None:
        rate = self.spec.level
        tasks: set[asyncio.Task] = set()
        at = self.t0
        slot = 0
        while True:
            at += int(self.rng.expovariate(rate) * 1e9)
            if not self.may_send(at):
                break
            delay = (at - time.perf_counter_ns()) / 1e9
            if delay > 0:
                await asyncio.sleep(delay)
            if len(tasks) >= self.spec.max_live_chats:
                continue
            task = asyncio.create_task(self._open_chat(slot, at))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            slot += 1
        if tasks:
            await asyncio.gather(*tasks)

    async def _open_chat(self, slot: int, at: int) -> None:
        session = self.idle_sessions.pop() if self.idle_sessions else self.t.session()
        try:
            await self.chat(self.new_conversation(), session, slot, at, think=True)
        finally:
            self.idle_sessions.append(session)

    async def run(self) -> None:
        spec = self.spec
        if spec.mode == "open":
            await self.open_loop()
            return
        n = int(spec.level)
        think = spec.mode == "closed"
        # Stagger the first turns over one mean think time so N chats do not start in lockstep.
        spread = self.w.profile.think_time_s.p.get("mean", 1.0) if think else 0.0
        starts = [self.t0 + int(self.rng.uniform(0, spread) * 1e9) for _ in range(n)]
        watchdog = None if self.window_open else asyncio.create_task(self._open_window_at_latest())
        try:
            await asyncio.gather(*(self.slot_loop(i, starts[i], think) for i in range(n)))
        finally:
            if watchdog is not None:
                watchdog.cancel()

    async def _open_window_at_latest(self) -> None:
        await asyncio.sleep(max(0.0, (self.latest_warm_end - time.perf_counter_ns()) / 1e9))
        self.open_window()


async def settle_run(main: asyncio.Task, done: set[asyncio.Task], records: list[RequestRecord]) -> None:
    """End a load run that had until its drain deadline: re-raise its error if it finished;
    otherwise cancel it and mark every request still in flight as timed out (none goes silent)."""
    if main in done:
        main.result()
        return
    main.cancel()
    await asyncio.gather(main, return_exceptions=True)
    for r in records:
        if r.status == "ok" and r.end_s is None:
            r.status, r.error = "timeout", "still in flight when the run's drain timeout ended"


async def run_load(workload: Workload, transport: Transport, cfg: ClientConfig, spec: LoadSpec, seed: int,
                   on_record: Callable[[RequestRecord], None] | None = None) -> LoadResult:
    """Drive one load point; returns every record (warmup ones marked)."""
    raise_fd_limit(int(spec.level) + 64 if spec.mode != "open" else 4096)
    started = time.time()
    # A full cyclic-GC pass over thousands of live chats stalls the loop for tens of ms and would
    # show up as latency; reference counting frees almost everything, so collect after the run.
    gc_was_on = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        run = _Run(workload, transport, cfg, spec, seed, on_record)
        main = asyncio.create_task(run.run())
        while True:  # the window's end moves once (a steady join opens it when its chats are in)
            end = run.end
            deadline = (end - time.perf_counter_ns()) / 1e9 + spec.drain_timeout_s
            done, _ = await asyncio.wait({main}, timeout=max(deadline, 0.0))
            if done or run.end == end:
                break
    finally:
        if gc_was_on:
            gc.enable()
    await settle_run(main, done, run.records)
    return LoadResult(spec, seed, run.t0, started, spec.duration_s, run.records, run.next_conv)
