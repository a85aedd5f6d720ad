"""The load loop sends one X-Session-ID per conversation and records each turn's pause; the
long-session profile is deterministic and pauses several times longer than it types."""

import asyncio
import json
import time

from chatfleet.bench.client import SESSION_HEADER, ClientConfig
from chatfleet.bench.dists import make
from chatfleet.bench.loops import LoadSpec, run_load
from chatfleet.bench.tokens import EstimateCounter
from chatfleet.bench.transport import Response
from chatfleet.bench.workload import Workload, get_profile


class RecordingSession:
    """Answers every chat with one content token and usage; remembers what it was sent."""

    def __init__(self, sent):
        self.sent = sent

    async def post(self, path, body, headers):
        self.sent.append((json.loads(body), dict(headers)))

        async def chunks():
            events = [{"choices": [{"delta": {"content": "hi"}}]},
                      {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 1,
                                                "prompt_tokens_details": {"cached_tokens": 4}}}]
            for e in events:
                yield time.perf_counter_ns(), f"data: {json.dumps(e)}\n\n".encode()
            yield time.perf_counter_ns(), b"data: [DONE]\n\n"

        return Response(200, {}, chunks())

    async def discard(self):
        pass


class RecordingTransport:
    name = "recording"

    def __init__(self):
        self.sent = []

    def session(self):
        return RecordingSession(self.sent)

    async def close(self):
        pass


def test_each_conversation_sends_its_own_session_id_and_records_pauses():
    prof = get_profile("long-session").with_overrides(think_time_s=make("lognormal", mean=0.02, sigma=0.3),
                                                      turns=make("const", value=3))
    w = Workload(prof, 5, EstimateCounter())
    t = RecordingTransport()
    spec = LoadSpec("closed", 3, duration_s=2.0, warmup_s=0.0, max_requests=12)
    res = asyncio.run(run_load(w, t, ClientConfig("m"), spec, seed=5))
    assert len(res.records) == len(t.sent) == 12
    by_conv = {}
    for rec, (_body, headers) in zip(res.records, t.sent, strict=True):  # both in send order
        by_conv.setdefault(rec.conv_id, set()).add(headers[SESSION_HEADER])
        assert headers[SESSION_HEADER] == rec.session_id
        assert (rec.pause_s is None) == (rec.turn == 0)
        if rec.turn > 0:
            assert rec.pause_s == w.conversation(rec.conv_id).turns[rec.turn].think_time_s > 0
        assert rec.cached_tokens == 4 and rec.prompt_tokens == 10
    assert all(len(ids) == 1 for ids in by_conv.values())  # one id per conversation
    assert len({next(iter(ids)) for ids in by_conv.values()}) == len(by_conv)  # distinct across conversations


def test_session_ids_can_be_turned_off():
    w = Workload(get_profile("cpu-roleplay"), 1, EstimateCounter())
    t = RecordingTransport()
    spec = LoadSpec("concurrency", 1, duration_s=0.2, warmup_s=0.0, max_requests=2)
    asyncio.run(run_load(w, t, ClientConfig("m", send_session_id=False), spec, seed=1))
    assert t.sent and all(SESSION_HEADER not in h for _, h in t.sent)


def test_long_session_profile_is_deterministic_and_pauses_longer_than_a_turn_takes():
    prof = get_profile("long-session")
    a = Workload(prof, 11, EstimateCounter())
    b = Workload(prof, 11, EstimateCounter())
    assert [a.conversation(i) for i in range(10)] == [b.conversation(i) for i in range(10)]
    convs = [a.conversation(i) for i in range(200)]
    pauses = [t.think_time_s for c in convs for t in c.turns[1:]]
    assert sum(pauses) / len(pauses) > 2.0  # a turn takes well under a second on CPU at the knee
    assert max(pauses) > 10 and min(pauses) >= 0.3  # lognormal: a long tail
    roleplay = Workload(get_profile("cpu-roleplay"), 11, EstimateCounter())
    assert min(len(c.turns) for c in convs) >= 6
    mean_card_tokens = sum(c.tokens for c in a.cards) / len(a.cards)
    assert mean_card_tokens > 2 * sum(c.tokens for c in roleplay.cards) / len(roleplay.cards)
    assert max(c.prompt_tokens(len(c.turns) - 1) for c in convs) <= prof.max_prompt_tokens + 64


def test_steady_join_sends_each_slots_first_chat_from_a_drawn_turn_with_its_history():
    prof = get_profile("long-session").with_overrides(think_time_s=make("lognormal", mean=0.01, sigma=0.3),
                                                      turns=make("uniform", low=4, high=8))
    w = Workload(prof, 3, EstimateCounter())
    t = RecordingTransport()
    spec = LoadSpec("closed", 4, duration_s=3.0, warmup_s=0.0, max_requests=60, join="steady")
    res = asyncio.run(run_load(w, t, ClientConfig("m"), spec, seed=3))
    first_of = {}
    for rec, (body, _) in zip(res.records, t.sent, strict=True):  # one record per chat sent, both in send order
        first_of.setdefault(rec.conv_id, (rec, body))
    joined = [(rec, body) for rec, body in first_of.values() if rec.turn > 0]
    assert joined, "some slot must have joined a chat past its first turn"
    for rec, body in first_of.values():
        conv = w.conversation(rec.conv_id)
        first_slot_chat = rec.conv_id < 4  # the slots' first chats are conversations 0-3
        assert rec.turn == (w.join_turn(conv) if first_slot_chat else 0)
        assert rec.pause_s is None  # the first request seen of a chat has no measured pause
        msgs = body["messages"]
        assert msgs == conv.messages(rec.turn, w.scripted_history(conv, rec.turn))
        assert len(msgs) == 2 + 2 * rec.turn  # card, every earlier turn pair, the new turn
        for k, reply in enumerate(w.scripted_history(conv, rec.turn)):
            assert msgs[2 + 2 * k]["content"] == reply and reply  # scripted history, non-empty
    # deterministic: the same seed joins the same turns with the same history
    assert [w.join_turn(w.conversation(i)) for i in range(4)] == \
        [Workload(prof, 3, EstimateCounter()).join_turn(w.conversation(i)) for i in range(4)]


def test_steady_join_is_for_the_closed_loop_only():
    import pytest

    from chatfleet.errors import ConfigError

    with pytest.raises(ConfigError, match="closed loop only"):
        LoadSpec("open", 1.0, join="steady")
    with pytest.raises(ConfigError, match="unknown join"):
        LoadSpec("closed", 1, join="middle")


class SlowSession(RecordingSession):
    async def post(self, path, body, headers):
        await asyncio.sleep(0.05)
        return await super().post(path, body, headers)


class SlowTransport(RecordingTransport):
    def session(self):
        return SlowSession(self.sent)


def test_steady_join_measures_only_after_every_joined_chat_has_its_first_reply():
    prof = get_profile("long-session").with_overrides(think_time_s=make("lognormal", mean=0.02, sigma=0.3),
                                                      turns=make("const", value=6))
    w = Workload(prof, 4, EstimateCounter())
    spec = LoadSpec("closed", 3, duration_s=0.6, warmup_s=0.0, drain_timeout_s=5.0, join="steady")
    res = asyncio.run(run_load(w, SlowTransport(), ClientConfig("m"), spec, seed=4))
    firsts = {}
    for rec in res.records:
        firsts.setdefault(rec.slot, rec)
    assert len(firsts) == 3 and all(r.warmup for r in firsts.values())  # warmup_s=0, yet warmup
    last_first_reply = max(r.end_s for r in firsts.values())
    measured = [r for r in res.records if not r.warmup]
    assert measured and all(r.sent_s >= last_first_reply - 1e-3 for r in measured)
    assert max(r.sent_s for r in res.records) <= last_first_reply + spec.duration_s + 0.05  # window moved


class SerialServer:
    """One request at a time, each ``service_s`` long: a queue forms when chats outpace it."""

    def __init__(self, sent, service_s):
        self.sent, self.service_s, self.lock = sent, service_s, None

    def session(self):
        return SerialSession(self)


class SerialSession(RecordingSession):
    def __init__(self, server):
        super().__init__(server.sent)
        self.server = server

    async def post(self, path, body, headers):
        if self.server.lock is None:
            self.server.lock = asyncio.Lock()
        async with self.server.lock:
            await asyncio.sleep(self.server.service_s)
            return await super().post(path, body, headers)


def test_steady_join_measures_only_after_the_queue_the_join_left_has_drained():
    prof = get_profile("long-session").with_overrides(think_time_s=make("lognormal", mean=0.01, sigma=0.3),
                                                      turns=make("const", value=8))
    w = Workload(prof, 8, EstimateCounter())
    spec = LoadSpec("closed", 8, duration_s=0.5, warmup_s=0.0, drain_timeout_s=10.0, join="steady")
    server = SerialServer([], service_s=0.02)
    res = asyncio.run(run_load(w, server, ClientConfig("m"), spec, seed=5))
    firsts = {}
    for rec in res.records:
        firsts.setdefault(rec.slot, rec)
    last_join = max(r.end_s for r in firsts.values())
    backlog = [r for r in res.records if r.sent_s < last_join - 1e-4 and r.end_s > last_join + 1e-4]
    assert backlog, "the serial server must leave requests queued when the last history is answered"
    drained = max(r.end_s for r in backlog)
    measured = [r for r in res.records if not r.warmup]
    assert measured and all(r.intended_s >= drained - 1e-3 for r in measured)
