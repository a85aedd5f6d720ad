"""The tool-call checker on fixtures, and the 40 cases themselves."""

import asyncio
import json
from collections import Counter

import httpx
import pytest

import chatfleet.gate.runner  # noqa: F401  (registers the suites)
from chatfleet.gate.client import GateClient, SamplingSettings
from chatfleet.gate.suite import SUITES, SuiteContext, SuiteSettings, Verdict
from chatfleet.gate.tool_cases import CASES, CATEGORY_COUNTS, FUNCTIONS, OMITTED
from chatfleet.gate.tool_check import check_reply, normalize_string

BY_ID = {c.case_id: c for c in CASES}


def call(name, **args):
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def test_the_cases_are_40_in_the_planned_categories_and_consistent():
    assert len(CASES) == 40 and len(BY_ID) == 40
    assert Counter(c.category for c in CASES) == CATEGORY_COUNTS
    for case in CASES:
        assert (case.category == "no_call") == (not case.expected)
        for name, args in case.expected:
            assert name in case.tools
            props = FUNCTIONS[name]["function"]["parameters"]["properties"]
            required = FUNCTIONS[name]["function"]["parameters"]["required"]
            assert set(args) <= set(props) and set(required) <= set(args), case.case_id
            assert all(OMITTED not in args[r] for r in required), case.case_id


def test_an_exact_call_matches_and_strings_are_normalized():
    case = BY_ID["simple-05"]
    assert check_reply(case, [call("book_table", restaurant="LUIGI'S", people=4, time="7:30 PM")], "").correct
    assert normalize_string(" Paris, France ") == "parisfrance"


@pytest.mark.parametrize("calls, reason", [
    ([call("get_weather", city="Paris")], "expected 'book_table'"),
    ([call("book_table", restaurant="Luigi's", people=4)], "missing required argument 'time'"),
    ([call("book_table", restaurant="Luigi's", people=4, time="19:30", notes="x")], "unexpected argument 'notes'"),
    ([call("book_table", restaurant="Luigi's", people="4", time="19:30")], "people='4' is not a valid integer"),
    ([call("book_table", restaurant="Luigi's", people=True, time="19:30")], "not a valid integer"),
    ([call("book_table", restaurant="Luigi's", people=5, time="19:30")], "people=5 not among [4]"),
    ([], "0 calls, expected 1"),
])
def test_each_kind_of_mismatch_is_caught(calls, reason):
    out = check_reply(BY_ID["simple-05"], calls, "")
    assert not out.correct and not out.invalid_json and reason in out.reason


def test_optional_arguments_may_be_left_out_only_where_allowed():
    assert check_reply(BY_ID["simple-01"], [call("get_weather", city="Paris")], "").correct
    assert not check_reply(BY_ID["simple-02"], [call("get_weather", city="Phoenix")], "").correct  # unit asked for
    assert not check_reply(BY_ID["simple-02"], [call("get_weather", city="Phoenix", unit="kelvin")], "").correct


def test_parallel_calls_match_in_any_order_and_count_must_match():
    case = BY_ID["parallel-02"]
    calls = [call("get_stock_price", symbol=s) for s in ("TSLA", "AAPL", "GOOG")]
    assert check_reply(case, calls, "").correct
    assert "2 calls, expected 3" in check_reply(case, calls[:2], "").reason
    assert not check_reply(case, calls[:2] + [call("get_stock_price", symbol="AAPL")], "").correct
    mixed = BY_ID["parmul-01"]
    assert check_reply(mixed, [call("get_stock_price", symbol="nvda"), call("get_weather", city="Vienna")], "").correct


def test_numbers_compare_by_value_and_arrays_elementwise():
    assert check_reply(BY_ID["simple-03"], [call("convert_currency", amount=250.0, from_currency="usd",
                                                 to_currency="EUR")], "").correct
    ev = BY_ID["simple-12"]
    sync = {"title": "Team sync", "date": "2025-03-14"}
    assert check_reply(ev, [call("create_event", **sync, attendees=["Bob", "Alice"])], "").correct
    assert not check_reply(ev, [call("create_event", **sync, attendees=["bob"])], "").correct


def test_invalid_json_and_unparsed_tool_call_text_count_as_invalid():
    bad = [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": '}}]
    out = check_reply(BY_ID["simple-01"], bad, "")
    assert out.invalid_json and not out.correct
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"</tool_call>'
    assert check_reply(BY_ID["simple-01"], None, text).invalid_json


def test_no_call_cases_want_no_call():
    case = BY_ID["nocall-01"]
    assert check_reply(case, None, "Why did the cat sit on the laptop?").correct
    assert not check_reply(case, [call("get_weather", city="Paris")], "").correct


def test_tools_required_forces_calls_on_the_cases_where_a_call_is_right():
    by_user = {c.user: c for c in CASES}
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body["tool_choice"])
        case = by_user[body["messages"][-1]["content"]]
        calls = [{"type": "function", "function": {"name": name, "arguments": json.dumps(
            {k: next(v for v in vals if v != OMITTED) for k, vals in args.items() if vals != [OMITTED]})}}
            for name, args in case.expected]
        msg = {"role": "assistant", "content": "", "tool_calls": calls}
        return httpx.Response(200, json={"choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls"}]})

    def client() -> GateClient:
        c = GateClient("http://scripted", model="m")
        c.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        return c

    ctx = SuiteContext(client(), client(), SamplingSettings(), SuiteSettings())
    result = asyncio.run(SUITES.make("tools_required", ctx))
    n_call = sum(1 for c in CASES if c.expected)
    assert n_call == 36 and result.metrics["cases"] == n_call and result.metrics["tool_choice"] == "required"
    assert set(seen) == {"required"} and result.verdict is Verdict.PASS
    assert result.metrics["table"]["both"] == n_call
