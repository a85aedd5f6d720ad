"""Tool calls: the project's 40 cases sent to both servers with ``tools``, in two suites.

- ``tools`` (``tool_choice: "auto"``): does the model decide rightly whether to call, which
  function, with which arguments, and does it write the call in its format (invalid JSON counts)?
- ``tools_required`` (``tool_choice: "required"``): the 36 cases where a call is right, each
  forced to call. The server's constrained decoding makes every reply a call of an offered
  function with schema-valid arguments, so this measures the arguments and the choice among
  functions under a forced call, and any invalid JSON is the server's fault, not the model's.

Each reply is checked like an AST match (``tool_check.py``). Decision: losses minus gains <= 0
(a case the baseline got right and the candidate did not is a loss) and no new invalid JSON.
Tango's and Newcombe's intervals are reported, not decided on: at n = 40 no interval can
certify a one-point drop. The A/A check asks the baseline the first cases twice; if its own
answers disagree more often than allowed, the run is invalid.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from chatfleet.gate.client import GateClient
from chatfleet.gate.stats import PairedTable, mcnemar_exact_p, newcombe_interval, tango_interval
from chatfleet.gate.suite import SUITES, SuiteContext, SuiteResult, Verdict, error_rate_reason
from chatfleet.gate.tool_cases import CASES, ToolCase
from chatfleet.gate.tool_check import check_reply

NAME = "tools"
REQUIRED_NAME = "tools_required"


async def _ask(ctx: SuiteContext, client: GateClient, case: ToolCase, choice: str = "auto",
               name: str = NAME) -> dict:
    reply = await client.chat(case.messages(), ctx.sampling, ctx.settings.tools_max_tokens, tools=case.tool_specs(),
                              tool_choice=choice)
    ctx.progress.advance(name)
    item: dict = {"id": case.case_id, "category": case.category}
    if not reply.ok:
        item["error"] = reply.error
        return item
    check = check_reply(case, reply.tool_calls, reply.text)
    item.update(content=reply.text, tool_calls=reply.tool_calls, finish_reason=reply.finish_reason, **check.to_dict())
    return item


def _signature(item: dict) -> object:
    return (item.get("content"), [(c["name"], c["arguments"]) for c in item.get("calls", [])])


def _suite(name: str, choice: str) -> Callable[[SuiteContext], Awaitable[SuiteResult]]:
    async def run(ctx: SuiteContext) -> SuiteResult:
        return await _run(ctx, name, choice)

    run.__doc__ = f"The tool-call suite with tool_choice {choice!r}."
    return run


async def _run(ctx: SuiteContext, name: str, choice: str) -> SuiteResult:
    t0 = time.monotonic()
    s = ctx.settings
    cases = CASES[:s.tools_limit] if s.tools_limit else CASES
    if choice == "required":  # a forced call cannot be right where no call is
        cases = tuple(c for c in cases if c.expected)
    aa_n = min(s.aa_items, len(cases))
    ctx.progress.total(name, 2 * len(cases) + aa_n)
    base, cand, aa = await asyncio.gather(
        asyncio.gather(*(_ask(ctx, ctx.baseline, c, choice, name) for c in cases)),
        asyncio.gather(*(_ask(ctx, ctx.candidate, c, choice, name) for c in cases)),
        asyncio.gather(*(_ask(ctx, ctx.baseline, c, choice, name) for c in cases[:aa_n])))
    base, cand = list(base), list(cand)
    aa_pairs = [(a, b) for a, b in zip(aa, base, strict=False) if "error" not in a and "error" not in b]
    disagreement = sum(_signature(a) != _signature(b) for a, b in aa_pairs) / len(aa_pairs) if aa_pairs else 0.0
    errors = sum(1 for b, c in zip(base, cand, strict=True) if "error" in b or "error" in c)
    metrics: dict = {"cases": len(cases), "errors": errors, "tool_choice": choice,
                     "aa": {"items": len(aa_pairs), "disagreement": disagreement}}
    invalid = error_rate_reason(errors, len(cases), s.max_error_rate)
    if not invalid and disagreement > s.aa_max_disagreement:
        invalid = (f"A/A: the baseline answered {100 * disagreement:.0f}% of the first {len(aa_pairs)} cases "
                   f"differently the second time (greedy is not deterministic there)")
    both = [(b, c) for b, c in zip(base, cand, strict=True) if "error" not in b and "error" not in c]
    table = PairedTable.from_pairs([(b["correct"], c["correct"]) for b, c in both])
    new_invalid = sum(1 for b, c in both if c["invalid_json"] and not b["invalid_json"])
    by_category: dict[str, dict] = {}
    for b, c in both:
        cat = by_category.setdefault(b["category"], {"n": 0, "baseline": 0, "candidate": 0})
        cat["n"] += 1
        cat["baseline"] += b["correct"]
        cat["candidate"] += c["correct"]
    metrics.update(table=table.to_dict(), losses=table.baseline_only, gains=table.candidate_only,
                   new_invalid_json=new_invalid, invalid_json={"baseline": sum(b["invalid_json"] for b, _ in both),
                                                               "candidate": sum(c["invalid_json"] for _, c in both)},
                   by_category=by_category, mcnemar_p=mcnemar_exact_p(table), intervals={
                       "tango": tango_interval(table, s.confidence).to_dict(),
                       "newcombe": newcombe_interval(table, s.confidence).to_dict()})
    worst = [{"id": b["id"], "category": b["category"], "baseline": f"{b['calls']} {b['content'][:200]}",
              "candidate": f"{c['calls']} {c['content'][:200]}", "why": c["reason"]}
             for b, c in both if b["correct"] and not c["correct"]][:5]
    notes = [f"the intervals are reported, not decided on: at n={len(cases)} no interval can certify a 1-point drop"]
    if invalid:
        result = SuiteResult(name, Verdict.INVALID, invalid, metrics, base, cand, worst, notes)
    else:
        net = table.baseline_only - table.candidate_only
        ok = net <= 0 and new_invalid == 0
        reason = (f"{table.baseline_only} losses, {table.candidate_only} gains (losses - gains = {net} "
                  f"{'<=' if net <= 0 else '>'} 0), {new_invalid} new invalid JSON; correct "
                  f"{table.both + table.baseline_only} -> {table.both + table.candidate_only} of {table.n}")
        result = SuiteResult(name, Verdict.PASS if ok else Verdict.FAIL, reason, metrics, base, cand, worst, notes)
    result.wall_s = time.monotonic() - t0
    return result


run = _suite(NAME, "auto")
run_required = _suite(REQUIRED_NAME, "required")
SUITES.register(NAME)(run)
SUITES.register(REQUIRED_NAME)(run_required)
