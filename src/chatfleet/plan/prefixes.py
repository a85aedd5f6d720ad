"""Prefix stability of real chat requests: where requests that should share a prefix diverge.

Three kinds of divergence, each detected and fixed on a copy of the sample:

- ``timestamp``: a date or time in the system prompt (requests differ only there). Fix: the
  timestamp moves behind the conversation (a note on the last message).
- ``tool_order``: the same tools in a different order. Fix: tools sorted by name.
- ``per_user_field``: a short per-user segment (a name, an id) inside a system prompt that is
  otherwise the same. Fix: it moves behind the conversation too.

Rendering: tools first (one JSON line each, in the order sent, as templates put them at the
start of the system turn), then the messages through the model's chat template.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from chatfleet.errors import ConfigError

TIMESTAMP = re.compile(
    r"\d{4}-\d{2}-\d{2}(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"  # ISO dates and times
    r"|\b\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp][Mm])?"  # clock times
    r"|\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,? (?:\d{1,2} )?"  # weekday dates: "Tue, 4 March 12" ...
    r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* \d{1,2}(?:, \d{4})?"
    r"|\b1[6-9]\d{8}\b"  # unix seconds
)
MAX_FIELD_CHARS = 200  # a per-user segment longer than this (or over 20% of the prompt) is a different prompt
KINDS = ("timestamp", "tool_order", "per_user_field")


@dataclass(frozen=True)
class Divergence:
    kind: str
    requests: int  # how many requests it affects
    description: str
    example: str


def read_requests(path: str | os.PathLike) -> list[dict[str, Any]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{path}:{n}: not JSON: {e}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
                raise ConfigError(f"{path}:{n}: expected an OpenAI chat request with a non-empty 'messages' list")
            out.append(obj)
    if not out:
        raise ConfigError(f"{path}: no requests")
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _system(req: dict[str, Any]) -> str | None:
    first = req["messages"][0]
    return _text(first.get("content")) if first.get("role") in ("system", "developer") else None


def _tool_names(req: dict[str, Any]) -> list[str]:
    return [str((t.get("function") or t).get("name", "")) for t in req.get("tools") or [] if isinstance(t, dict)]


def _move_behind(req: dict[str, Any], system: str, moved: list[str]) -> None:
    req["messages"][0]["content"] = system
    if moved:
        last = req["messages"][-1]
        last["content"] = _text(last.get("content")) + "\n\n[" + "; ".join(moved) + "]"


def _common_affixes(texts: list[str]) -> tuple[int, int]:
    first, last = min(texts), max(texts)  # the lexicographic extremes bound the common prefix
    p = os.path.commonprefix([first, last])
    s = os.path.commonprefix([t[::-1] for t in texts])
    return len(p), len(s)


def analyze(requests: list[dict[str, Any]]) -> tuple[list[Divergence], list[dict[str, Any]]]:
    """The divergences found, and the requests with each one fixed."""
    fixed = copy.deepcopy(requests)
    found: list[Divergence] = []
    # timestamps in the system prompt
    systems = [_system(r) for r in fixed]
    stamped = {i: s for i, s in enumerate(systems) if s is not None and TIMESTAMP.search(s)}
    if stamped and len(set(stamped.values())) > 1:
        for i, stamped_text in stamped.items():
            stamps = TIMESTAMP.findall(stamped_text)
            systems[i] = unstamped = TIMESTAMP.sub("", stamped_text)
            _move_behind(fixed[i], unstamped, [f"time: {' '.join(stamps)}"])
        ex = TIMESTAMP.search(_system(requests[next(iter(stamped))]) or "")
        found.append(Divergence("timestamp", len(stamped), "a date/time inside the system prompt changes every request",
                                ex.group(0) if ex else ""))
    # tools in a different order
    orders = Counter(tuple(_tool_names(r)) for r in fixed if r.get("tools"))
    if len(orders) > 1 and len({tuple(sorted(o)) for o in orders}) < len(orders):
        affected = 0
        for r in fixed:
            if r.get("tools"):
                before = _tool_names(r)
                r["tools"] = sorted(r["tools"], key=lambda t: str((t.get("function") or t).get("name", "")))
                affected += before != _tool_names(r)
        found.append(Divergence("tool_order", affected, f"the same tools sent in {len(orders)} different orders",
                                " / ".join(",".join(o) for o in list(orders)[:2])))
    # a per-user segment inside an otherwise shared system prompt
    present = {i: s for i, s in enumerate(systems) if s is not None}
    distinct = sorted(set(present.values()))
    if len(distinct) > 1:
        p, s = _common_affixes(distinct)
        longest = max(len(t) for t in distinct)
        p = min(p, min(len(t) for t in distinct))
        s = min(s, min(len(t) for t in distinct) - p)
        middles = [t[p:len(t) - s] for t in distinct]
        widest = max(len(m) for m in middles)
        if widest <= MAX_FIELD_CHARS and widest <= 0.2 * longest:
            for i, text in present.items():
                field = text[p:len(text) - s]
                _move_behind(fixed[i], text[:p] + text[len(text) - s:], [f"user: {field}"] if field else [])
            found.append(Divergence(
                "per_user_field", len(present),
                f"a per-user segment at character {p} of the system prompt, before the conversation", middles[0]))
    return found, fixed


def render(tokenizer: Any, req: dict[str, Any]) -> list[int]:
    tools = "".join(json.dumps(t, ensure_ascii=False, sort_keys=True) + "\n" for t in req.get("tools") or [])
    messages = [{"role": m.get("role", "user"), "content": _text(m.get("content"))} for m in req["messages"]]
    head = tokenizer.encode("# Tools\n" + tools) if tools else []
    return head + tokenizer.encode_chat(messages, add_generation_prompt=True)


def shared_prefix(token_lists: list[list[int]]) -> int:
    """Tokens every request starts with."""
    return len(os.path.commonprefix(token_lists)) if token_lists else 0
