"""`plan prefixes`: each kind of divergence is found and named, and fixing it raises the engine's hit rate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatfleet.cli.main import app
from chatfleet.engine.runner.sim_runner import make_byte_tokenizer
from chatfleet.errors import ConfigError
from chatfleet.plan.prefix_hits import engine_hit_rate
from chatfleet.plan.prefixes import analyze, read_requests, render, shared_prefix

FIXTURES = Path(__file__).parent / "fixtures"
SYSTEM = "You are a helpful tavern keeper. Describe the room in detail and stay in character. " * 4


def _req(system: str, user: str = "hi", tools: list[str] | None = None) -> dict:
    r = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    if tools:
        r["tools"] = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in tools]
    return r


@pytest.mark.parametrize("kind, requests", [
    ("timestamp", [_req(f"Now: 2026-11-{d:02d} 10:{d:02d}. " + SYSTEM) for d in range(1, 6)]),
    ("tool_order", [_req(SYSTEM, tools=o)
                    for o in (["a", "b", "c"], ["c", "a", "b"], ["b", "c", "a"], ["a", "b", "c"])]),
    ("per_user_field", [_req(SYSTEM + f"The user is {n}. " + SYSTEM) for n in ("ann", "bo", "cy", "dee")]),
])
def test_each_divergence_is_named_and_fixing_it_restores_the_shared_prefix(kind, requests):
    found, fixed = analyze(requests)
    assert [d.kind for d in found] == [kind]
    tok = make_byte_tokenizer()
    sent = [render(tok, r) for r in requests]
    repaired = [render(tok, r) for r in fixed]
    assert shared_prefix(repaired) > shared_prefix(sent) + 300
    before, after = engine_hit_rate(sent), engine_hit_rate(repaired)
    assert after.rate > before.rate and after.prompt_tokens >= before.prompt_tokens - 10


def test_different_prompts_are_not_a_per_user_field():
    found, _ = analyze([_req(SYSTEM), _req("You are a pirate captain on a stormy sea, loud and rude. " * 4)])
    assert found == []


def test_engine_hit_rate_counts_whole_cached_blocks():
    shared = list(range(1, 65))  # four blocks of 16
    hr = engine_hit_rate([shared + [100], shared + [101], shared[:40] + [102]])
    assert hr.prompt_tokens == 65 + 65 + 41 and hr.cached_tokens == 64 + 32


def test_cli_reports_all_three_kinds_and_the_rates():
    res = CliRunner().invoke(app, ["plan", "prefixes", str(FIXTURES / "divergent_requests.jsonl")])
    assert res.exit_code == 0, res.output
    for kind in ("timestamp", "tool_order", "per_user_field"):
        assert kind in res.output
    hit_rates = res.output.split("hit rate:")[1].split("fixed")[0].replace("as sent,", "")
    rates = [float(x) for x in hit_rates.split("%")[:2]]
    assert rates[1] > rates[0] + 30
    stable = CliRunner().invoke(app, ["plan", "prefixes", str(FIXTURES / "stable_requests.jsonl")])
    assert stable.exit_code == 0 and "no divergence" in stable.output


def test_bad_input(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps({"messages": []}) + "\n")
    with pytest.raises(ConfigError, match="non-empty 'messages'"):
        read_requests(p)
