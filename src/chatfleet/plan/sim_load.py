"""The bench's traffic in virtual time: its workloads (``bench/workload.py``: cards, Zipf
popularity, turns, think times, history dropped past ``max_prompt_tokens``) and its load modes
(``bench/loops.py``: closed loop of N live chats, each replaced by a new chat after a think time;
open loop of Poisson-arriving chats; fixed concurrency), with the same seeds, warmup marking,
request bound and drain timeout, written as coroutines for the virtual-time loop.

Requests are token ids, not text: a character's card is one fixed id sequence (so chats of one
character share its prefix), each user turn its own ids, each reply the ids the engine produced
(so a returning turn's prompt extends the previous one and hits the prefix cache as it would
live), with ``TOKENS_PER_MESSAGE`` framing ids around each message as the workload counts them.
With ``token_scale`` k > 1 (coarse time) every length is divided by k, rounding up.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from chatfleet.bench.loops import LoadResult, LoadSpec, settle_run
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.tokens import TOKENS_PER_MESSAGE, TOKENS_PER_PROMPT
from chatfleet.bench.workload import Conversation, Workload
from chatfleet.errors import ConfigError
from chatfleet.plan.virtual_loop import VirtualClock

_ID_LOW, _ID_HIGH = 1000, 1 << 30


@dataclass(frozen=True)
class TurnRequest:
    """One request a chat sends: everything a target needs to serve and route it."""

    request_id: str
    session: str  # the conversation's session key (gateway affinity)
    returning: bool  # a later turn of a conversation in progress
    prompt: list[int]
    max_tokens: int
    prefix_group: str | None = None  # requests that start with the same prefix (the character's card)


# A target serves one request and fills its record; returns the reply's token ids ([] on failure).
Target = Callable[[TurnRequest, RequestRecord, float, float], Awaitable[list[int]]]


class TokenizedWorkload:
    """Token ids for a workload's conversations (cards cached per character)."""

    def __init__(self, workload: Workload, token_scale: int = 1) -> None:
        self.w = workload
        self.k = token_scale
        self._cards: dict[int, list[int]] = {}
        self._head = list(range(1, 1 + self.scaled(TOKENS_PER_PROMPT)))
        self._frame = {role: list(range(10 * i, 10 * i + self.scaled(TOKENS_PER_MESSAGE)))
                       for i, role in enumerate(("system", "user", "assistant"), 1)}

    def scaled(self, n: int) -> int:
        return -(-n // self.k)

    def _ids(self, n: int, *key: int) -> list[int]:
        """``n`` (scaled) pseudo-random ids for ``key``: SHAKE-128 of the seed and key, a few
        microseconds for a user turn (a seeded generator per turn cost ten times more)."""
        m = self.scaled(n)
        stream = hashlib.shake_128(":".join(map(str, (self.w.seed, *key))).encode()).digest(4 * m)
        return (np.frombuffer(stream, dtype="<u4") % (_ID_HIGH - _ID_LOW) + _ID_LOW).tolist()

    def card(self, conv: Conversation) -> list[int]:
        ids = self._cards.get(conv.character_id)
        if ids is None:
            ids = self._head + self._frame["system"] + self._ids(conv.system_tokens, 0, conv.character_id)
            self._cards[conv.character_id] = ids
        return ids

    def user(self, conv: Conversation, turn: int) -> list[int]:
        return self._frame["user"] + self._ids(conv.turns[turn].user_tokens, 1, conv.conv_id, turn)

    def prompt(self, conv: Conversation, turn: int, replies: list[list[int]], users: list[list[int]],
               previous: tuple[int, list[int]] | None = None) -> tuple[int, list[int]]:
        """The request of ``turn`` (with the first history turn it keeps): card, the history kept
        (oldest pairs dropped as the workload does), the new user turn. ``previous``: what this
        returned for ``turn - 1``, extended instead of rebuilt where it kept the same history."""
        first = previous[0] if previous is not None else 0  # the history only ever loses its oldest turns
        while first < turn and conv.prompt_tokens(turn, first) > conv.max_prompt_tokens:
            first += 1
        if previous is not None and previous[0] == first and turn > first:
            return first, [*previous[1], *self._frame["assistant"], *replies[turn - 1], *users[turn]]
        out = list(self.card(conv))
        for i in range(first, turn):
            out += users[i] + self._frame["assistant"] + replies[i]
        return first, out + users[turn]


@dataclass
class _SimRun:
    tw: TokenizedWorkload
    target: Target
    spec: LoadSpec
    seed: int
    clock: VirtualClock
    on_record: Callable[[RequestRecord], None] | None = None
    records: list[RequestRecord] = field(default_factory=list)
    next_conv: int = 0
    sent: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(f"load:{self.seed}")
        self.t0 = self.clock()
        self.warm_end = self.t0 + self.spec.warmup_s
        self.end = self.warm_end + self.spec.duration_s

    def may_send(self, at: float) -> bool:
        return at < self.end and (self.spec.max_requests is None or self.sent < self.spec.max_requests)

    async def chat(self, conv: Conversation, slot: int, start: float, think: bool) -> None:
        replies: list[list[int]] = []
        users: list[list[int]] = []
        built: tuple[int, list[int]] | None = None  # the last prompt sent (its first history turn)
        intended = start
        for ti, turn in enumerate(conv.turns):
            if ti > 0 and think:
                intended += turn.think_time_s
            if not self.may_send(intended):
                return
            delay = intended - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
                if not self.may_send(intended):
                    return
            self.sent += 1
            rec = RequestRecord(conv.conv_id, ti, conv.character_id, slot, 0.0, expected_tokens=turn.reply_tokens,
                                warmup=intended < self.warm_end,
                                pause_s=(turn.think_time_s if think else 0.0) if ti > 0 else None)
            rec.intended_s = intended - self.t0
            self.records.append(rec)
            users.append(self.tw.user(conv, ti))
            built = self.tw.prompt(conv, ti, replies, users, built)
            req = TurnRequest(f"s{self.seed}-c{conv.conv_id}-t{ti}", f"s{self.seed}-c{conv.conv_id}", ti > 0,
                              built[1], self.tw.scaled(turn.reply_tokens), f"s{self.seed}-card{conv.character_id}")
            reply = await self.target(req, rec, self.t0, intended)
            if self.on_record is not None:
                self.on_record(rec)
            if rec.status != "ok":
                return
            replies.append(reply)
            intended = self.t0 + (rec.end_s or 0.0)

    async def slot_loop(self, slot: int, first_start: float, think: bool) -> None:
        start = first_start
        while self.may_send(start):
            conv = self.tw.w.conversation(self.next_conv)
            self.next_conv += 1
            await self.chat(conv, slot, start, think)
            start = self.clock() + (self.tw.w.first_think_time(conv.conv_id) if think else 0.0)

    async def open_loop(self) -> None:
        tasks: set[asyncio.Task] = set()
        at = self.t0
        slot = 0
        while True:
            at += self.rng.expovariate(self.spec.level)
            if not self.may_send(at):
                break
            delay = at - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(tasks) >= self.spec.max_live_chats:
                continue
            conv = self.tw.w.conversation(self.next_conv)
            self.next_conv += 1
            task = asyncio.create_task(self.chat(conv, slot, at, think=True))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            slot += 1
        if tasks:
            await asyncio.gather(*tasks)

    async def run(self) -> None:
        if self.spec.mode == "open":
            await self.open_loop()
            return
        n = int(self.spec.level)
        think = self.spec.mode == "closed"
        spread = self.tw.w.profile.think_time_s.p.get("mean", 1.0) if think else 0.0
        starts = [self.t0 + self.rng.uniform(0, spread) for _ in range(n)]
        await asyncio.gather(*(self.slot_loop(i, starts[i], think) for i in range(n)))


async def run_sim_load(workload: Workload, target: Target, spec: LoadSpec, seed: int, clock: VirtualClock,
                       on_record: Callable[[RequestRecord], None] | None = None, token_scale: int = 1) -> LoadResult:
    """Drive one load point against ``target`` in virtual time; every record, warmup ones marked."""
    if spec.join != "start":
        raise ConfigError(f"the simulator starts every chat at its first turn; join {spec.join!r} is not simulated")
    run = _SimRun(TokenizedWorkload(workload, token_scale), target, spec, seed, clock, on_record)
    main = asyncio.create_task(run.run())
    deadline = run.end - clock() + spec.drain_timeout_s
    done, _ = await asyncio.wait({main}, timeout=max(deadline, 0.0))
    await settle_run(main, done, run.records)
    return LoadResult(spec, seed, 0, 0.0, spec.duration_s, run.records, run.next_conv)
