import json
import random

import numpy as np
import pytest

from chatfleet.bench.dists import parse_dist
from chatfleet.bench.tokens import EstimateCounter, load_counter
from chatfleet.bench.traces import export_jsonl, import_jsonl, import_sharegpt
from chatfleet.bench.workload import Workload, get_profile
from chatfleet.bench.workload_stats import describe
from chatfleet.errors import ConfigError


@pytest.fixture(scope="module")
def tiny_counter():
    return load_counter("tiny")


def test_same_seed_same_trace_other_seed_other_trace():
    a = Workload(get_profile("cpu-roleplay"), 7, EstimateCounter(), scripted_replies=True)
    b = Workload(get_profile("cpu-roleplay"), 7, EstimateCounter(), scripted_replies=True)
    c = Workload(get_profile("cpu-roleplay"), 8, EstimateCounter(), scripted_replies=True)
    # Order of requests must not matter (closed-loop slots finish in any order).
    assert [a.conversation(i) for i in range(20)] == [b.conversation(i) for i in reversed(range(20))][::-1]
    assert [a.conversation(i) for i in range(5)] != [c.conversation(i) for i in range(5)]


def test_requests_carry_card_history_and_new_turn():
    w = Workload(get_profile("cpu-roleplay"), 1, EstimateCounter())
    conv = next(c for c in (w.conversation(i) for i in range(50)) if len(c.turns) >= 3)
    msgs = conv.messages(2, ["first reply", "second reply"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[0]["content"] == conv.system
    assert msgs[2]["content"] == "first reply" and msgs[-1]["content"] == conv.turns[2].user
    # Many conversations share one card.
    ids = [w.conversation(i).character_id for i in range(200)]
    assert len(set(ids)) < len(ids) / 4
    assert max(ids.count(i) for i in set(ids)) > 200 / len(set(ids))  # Zipf: the top card is over-represented


def test_seed_roleplay_matches_its_profile(tiny_counter):
    prof = get_profile("seed-roleplay")
    w = Workload(prof, 3, tiny_counter)
    s = describe(w, n=300)
    assert 5000 <= s.request_tokens_mean <= 6000, s  # ~5.5K mean
    assert 8200 <= s.request_tokens_p95 <= 9800, s  # ~9K at p95
    assert s.reply_tokens_max <= 300
    rng = random.Random(0)
    want = {name: np.mean([getattr(prof, name).sample(rng) for _ in range(20000)])
            for name in ("card_tokens", "user_tokens", "reply_tokens", "turns", "think_time_s")}
    assert np.mean([c.tokens for c in w.cards]) == pytest.approx(want["card_tokens"], rel=0.1)
    assert s.user_tokens_mean == pytest.approx(want["user_tokens"], rel=0.15)
    assert s.reply_tokens_mean == pytest.approx(want["reply_tokens"], rel=0.05)
    assert s.turns_mean == pytest.approx(want["turns"], rel=0.1)
    assert s.think_time_s_mean == pytest.approx(want["think_time_s"], rel=0.1)
    assert set(s.languages) == {"en", "es", "de", "ru"}


def test_cards_in_four_languages_one_non_latin():
    counter = EstimateCounter()
    w = Workload(get_profile("cpu-roleplay").with_overrides(num_characters=40), 2, counter)
    by_lang = {c.language: c.text for c in w.cards}
    assert set(by_lang) == {"en", "es", "de", "ru"}
    assert any("\u0400" <= ch <= "\u04ff" for ch in by_lang["ru"])  # Cyrillic
    assert "Имя:" in by_lang["ru"] and "Persönlichkeit:" in by_lang["de"]


def test_trace_roundtrip_and_sharegpt(tmp_path):
    prof = get_profile("cpu-roleplay")
    w = Workload(prof, 5, EstimateCounter(), scripted_replies=True)
    path = export_jsonl(w, 10, tmp_path / "t.jsonl")
    back = import_jsonl(path, prof, EstimateCounter())
    for i in range(10):
        a, b = w.conversation(i), back.conversation(i)
        assert [(t.user, t.reply, t.reply_tokens, t.think_time_s) for t in a.turns] == \
               [(t.user, t.reply, t.reply_tokens, t.think_time_s) for t in b.turns]
        assert a.messages(len(a.turns) - 1) == b.messages(len(b.turns) - 1)
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi " * 30},
                                      {"from": "human", "value": "how are you"}, {"from": "gpt", "value": "fine"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "orphan"}]},
    ]))
    tw = import_sharegpt(sg, prof, EstimateCounter())
    assert len(tw.conversations) == 1
    c = tw.conversation(0)
    assert [t.user for t in c.turns] == ["hello there", "how are you"]
    assert c.messages(1)[0] == {"role": "user", "content": "hello there"}
    assert c.turns[1].think_time_s > 0 and c.turns[0].reply_tokens > 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    with pytest.raises(ConfigError, match="bad.jsonl:1"):
        import_jsonl(bad, prof, EstimateCounter())


@pytest.mark.parametrize("spec", ["lognormal(mean=-1,sigma=1)", "weibull(k=1)", "uniform(low=3)",
                                  "uniform(low=1,high=2,x=3)", "lognormal(mean=1 sigma=1)"])
def test_bad_distributions_fail_clearly(spec):
    with pytest.raises(ConfigError):
        parse_dist(spec)


def test_distribution_clamps_and_unknown_profile():
    d = parse_dist("normal(mean=10,std=100,min=0,max=20)")
    rng = random.Random(1)
    assert all(0 <= d.sample(rng) <= 20 for _ in range(200))
    with pytest.raises(ConfigError, match="valid: seed-roleplay, cpu-roleplay"):
        get_profile("nope")


def test_pause_override_changes_only_the_mean_of_the_pauses():
    from chatfleet.bench.demo import DemoConfig
    from chatfleet.bench.dists import make, with_mean

    base = get_profile("long-session")
    profile = DemoConfig(pause_mean_s=8.0).workload_profile()
    assert profile.think_time_s == with_mean(base.think_time_s, 8.0)
    assert dict(profile.think_time_s.params)["sigma"] == dict(base.think_time_s.params)["sigma"]
    assert (profile.think_time_s.min, profile.think_time_s.max) == (base.think_time_s.min, base.think_time_s.max)
    assert profile.card_tokens == base.card_tokens and profile.turns == base.turns
    rng = random.Random(0)
    pauses = [profile.think_time_s.sample(rng) for _ in range(4000)]
    assert 6.5 < np.mean(pauses) < 8.5  # the clamp at max=60 trims the lognormal's tail a little
    assert DemoConfig().workload_profile() is base
    assert "mean pause 8 s" in DemoConfig(pause_mean_s=8.0).describe_profile()
    with pytest.raises(ConfigError, match="> 0"):
        DemoConfig(pause_mean_s=0.0)
    with pytest.raises(ConfigError, match="no mean"):
        with_mean(make("uniform", low=1, high=2), 3.0)
