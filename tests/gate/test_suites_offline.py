"""The suites' decisions against scripted servers (httpx mock transports, no engine): a
nondeterministic baseline switches GSM8K to sampled answers and says so; new invalid JSON fails
the tool suite; an A/A disagreement makes the tool suite invalid; failed requests make a run
invalid."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
from gate_data import GSM8K_TEST

import chatfleet.gate.runner  # noqa: F401  (registers the suites)
from chatfleet.gate.client import GateClient, SamplingSettings
from chatfleet.gate.gsm8k import load_problems
from chatfleet.gate.suite import SUITES, SuiteContext, SuiteSettings, Verdict
from chatfleet.gate.tool_cases import CASES

PROBLEMS = {p.question: p.gold for p in load_problems(GSM8K_TEST, limit=30)}
BY_USER = {c.user: c for c in CASES}


def client(reply) -> GateClient:
    """A GateClient whose server is ``reply(body) -> (status, json)``."""
    c = GateClient("http://scripted", model="m")

    def handler(request: httpx.Request) -> httpx.Response:
        status, body = reply(json.loads(request.content))
        return httpx.Response(status, json=body)

    c.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return c


def chat_reply(content: str, tool_calls=None):
    msg = {"role": "assistant", "content": content}
    if tool_calls is not None:
        msg["tool_calls"] = tool_calls
    return 200, {"choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]}


def run(suite: str, baseline: GateClient, candidate: GateClient, **settings):
    s = SuiteSettings(gsm8k_path=GSM8K_TEST, gsm8k_limit=30, gsm8k_shots=0, **settings)
    return asyncio.run(SUITES.make(suite, SuiteContext(baseline, candidate, SamplingSettings(), s)))


def math_answer(rng_correct: float, seed=None):
    rng = random.Random(seed)

    def reply(body):
        gold = PROBLEMS[body["messages"][-1]["content"]]
        # sampled requests carry their own seed: the same seed gives the same answer
        r = random.Random(f"{body['seed']}:{gold}") if body["temperature"] > 0 else rng
        return chat_reply(f"so #### {gold if r.random() < rng_correct else int(gold) + 1}")

    return reply


def test_gsm8k_greedy_that_disagrees_with_itself_switches_to_sampled_answers():
    result = run("gsm8k", client(math_answer(0.5)), client(math_answer(0.5, seed=1)), aa_items=10,
                 gsm8k_samples=3)
    assert result.metrics["aa"]["disagreement"] > 0.05
    assert result.metrics["mode"] == "sampled" and result.metrics["samples"] == 3
    assert any("sampled answers per question" in n for n in result.notes)
    assert "question-level bootstrap" in result.metrics["intervals"]
    assert result.verdict in (Verdict.PASS, Verdict.FAIL, Verdict.INCONCLUSIVE)


def test_gsm8k_deterministic_servers_use_the_paired_table():
    result = run("gsm8k", client(math_answer(1.0)), client(math_answer(1.0)))
    assert result.metrics["aa"]["disagreement"] == 0.0 and "mode" not in result.metrics
    # n=30 identical answers can neither certify a drop under 1 point nor show one: inconclusive, not a fail.
    assert result.metrics["table"]["both"] == 30 and result.verdict is Verdict.INCONCLUSIVE
    assert "too few questions" in result.reason


def right_calls(body, broken_case=None):
    case = BY_USER[body["messages"][-1]["content"]]
    assert body["tool_choice"] == "auto" and body["tools"] == case.tool_specs()
    assert body["temperature"] == 0 and body["top_p"] == 1 and "seed" in body and "max_tokens" in body
    if case.case_id == broken_case:
        return chat_reply("", [{"type": "function", "function": {"name": "x", "arguments": "{bad"}}])
    calls = [{"type": "function", "function": {"name": name, "arguments": json.dumps(
        {k: next(v for v in vals if v != "<omitted>") for k, vals in args.items() if vals != ["<omitted>"]})}}
        for name, args in case.expected]
    return chat_reply("" if calls else "no tool needed", calls or None)


def test_tools_all_right_passes_and_new_invalid_json_fails():
    ok = run("tools", client(right_calls), client(right_calls))
    assert ok.verdict is Verdict.PASS and ok.metrics["table"]["both"] == 40
    bad = run("tools", client(right_calls), client(lambda b: right_calls(b, broken_case="simple-03")))
    assert bad.verdict is Verdict.FAIL and bad.metrics["new_invalid_json"] == 1 and bad.metrics["losses"] == 1


def test_tools_aa_disagreement_and_errors_make_the_run_invalid():
    flip = random.Random(3)

    def flaky(body):
        return right_calls(body) if flip.random() < 0.5 else chat_reply("I will not call anything")

    aa = run("tools", client(flaky), client(right_calls))
    assert aa.verdict is Verdict.INVALID and "A/A" in aa.reason
    down = run("tools", client(right_calls), client(lambda b: (500, {"error": {"message": "boom"}})))
    assert down.verdict is Verdict.INVALID and "requests failed" in down.reason
