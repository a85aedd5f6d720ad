"""Checks a reply's tool calls against a case like an AST match (in the manner of the Berkeley
Function-Calling Leaderboard's AST checker): valid JSON arguments, the number of calls, and
for each expected call a distinct actual call with the same function name, every required
argument, no unexpected argument, values of the schema's types, and values among the
acceptable ones (strings compared after normalization; numbers by value).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import asdict, dataclass

from chatfleet.gate.tool_cases import FUNCTIONS, OMITTED, ToolCase

_STRIP = re.compile(r"[\s,./\-_*^'\"!?:;()]")


@dataclass(frozen=True)
class CallCheck:
    correct: bool
    invalid_json: bool
    reason: str  # "" when correct
    calls: list[dict]  # the calls as parsed: {"name", "arguments"}

    def to_dict(self) -> dict:
        return asdict(self)


def normalize_string(s: str) -> str:
    return _STRIP.sub("", s).lower()


def _type_ok(value: object, schema: dict) -> bool:
    t = schema.get("type")
    if t == "string":
        return isinstance(value, str) and ("enum" not in schema or value in schema["enum"])
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "array":
        return isinstance(value, list) and all(_type_ok(v, schema.get("items", {})) for v in value)
    if t == "object":
        return isinstance(value, dict)
    return True


def _same(value: object, expected: object) -> bool:
    if isinstance(expected, str) and isinstance(value, str):
        return normalize_string(value) == normalize_string(expected)
    if isinstance(expected, bool) or isinstance(value, bool):
        return value is expected
    if isinstance(expected, (int, float)) and isinstance(value, (int, float)):
        return float(value) == float(expected)
    if isinstance(expected, list) and isinstance(value, list):
        return len(value) == len(expected) and all(_same(v, e) for v, e in zip(value, expected, strict=True))
    return value == expected


def match_call(actual: dict, name: str, expected_args: dict[str, list]) -> str:
    """'' when ``actual`` matches the expected call, else why not."""
    if actual["name"] != name:
        return f"called {actual['name']!r}, expected {name!r}"
    schema = FUNCTIONS[name]["function"]["parameters"]
    props, required = schema["properties"], schema.get("required", [])
    args = actual["arguments"]
    for key in args:
        if key not in props:
            return f"{name}: unexpected argument {key!r}"
    for key in required:
        if key not in args:
            return f"{name}: missing required argument {key!r}"
    for key, value in args.items():
        if not _type_ok(value, props[key]):
            return f"{name}: {key}={value!r} is not a valid {props[key].get('type')}"
    for key, acceptable in expected_args.items():
        if key not in args:
            if OMITTED not in acceptable:
                return f"{name}: argument {key!r} left out"
            continue
        if not any(_same(args[key], a) for a in acceptable if a != OMITTED):
            return f"{name}: {key}={args[key]!r} not among {[a for a in acceptable if a != OMITTED]}"
    return ""


def parse_calls(tool_calls: list[dict] | None, content: str) -> tuple[list[dict], bool]:
    """(calls with parsed arguments, invalid JSON seen). Tool-call text the server could not
    parse (left in the content) counts as invalid JSON too."""
    calls, invalid = [], False
    for tc in tool_calls or ():
        fn = (tc or {}).get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "")
        except (ValueError, TypeError):
            invalid = True
            continue
        if not isinstance(args, dict):
            invalid = True
            continue
        calls.append({"name": fn.get("name"), "arguments": args})
    if "<tool_call>" in (content or ""):
        invalid = True
    return calls, invalid


def check_reply(case: ToolCase, tool_calls: list[dict] | None, content: str) -> CallCheck:
    calls, invalid = parse_calls(tool_calls, content)
    if invalid:
        return CallCheck(False, True, "a tool call is not valid JSON", calls)
    if len(calls) != len(case.expected):
        return CallCheck(False, False, f"{len(calls)} calls, expected {len(case.expected)}", calls)
    if not calls:
        return CallCheck(True, False, "", calls)
    first_reason = ""
    for order in itertools.permutations(range(len(calls))):
        reasons = [match_call(calls[i], name, args) for i, (name, args) in zip(order, case.expected, strict=True)]
        if not any(reasons):
            return CallCheck(True, False, "", calls)
        first_reason = first_reason or next(r for r in reasons if r)
    return CallCheck(False, False, first_reason, calls)
