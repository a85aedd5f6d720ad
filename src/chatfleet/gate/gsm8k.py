"""GSM8K (Cobbe et al. 2021): grade-school math, a paired comparison of exact numeric answers.

Questions come from a JSONL file (``question``, ``answer`` ending in ``#### N``); the few-shot
examples from another (the first ``shots`` lines of the training split). Each question is a
chat: a system line asking for ``#### <number>`` at the end, the examples as user/assistant
turns (calculator annotations ``<<...>>`` removed), then the question; greedy decoding.
An answer is read strictly from ``#### N`` first, else the last number in the reply.

Decision: Tango's score interval on the paired 2x2 table at 1 - 2 x (1 - confidence) (its ends
are one-sided bounds at the confidence): pass where the lower bound is >= -margin, fail where the
upper bound is < -margin, inconclusive between (``stats.non_inferiority``). Newcombe's
interval and the exact McNemar test are reported beside it. The A/A check answers the first
questions twice on the baseline; when greedy answers disagree with themselves more often than
allowed (nondeterministic batching), the suite takes several sampled answers per question from
each system and decides on a question-level paired bootstrap interval instead, and says so.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from pathlib import Path

from chatfleet.errors import ConfigError
from chatfleet.gate.client import Reply
from chatfleet.gate.stats import (
    PairedTable,
    bootstrap_mean_interval,
    mcnemar_exact_p,
    newcombe_interval,
    non_inferiority,
    tango_interval,
)
from chatfleet.gate.suite import SUITES, SuiteContext, SuiteResult, Verdict, error_rate_reason

NAME = "gsm8k"
SYSTEM = ("Solve the math problem step by step. Finish with a final line of the form "
          "'#### <number>' holding only the numeric answer.")
STRICT = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
ANNOTATION = re.compile(r"<<[^>]*>>")


@dataclass(frozen=True)
class Problem:
    item_id: int
    question: str
    answer: str  # the reference solution
    gold: str  # normalized numeric answer


def normalize_number(text: str | None) -> str | None:
    """'1,234.50' -> '1234.5'; None when it is not a number."""
    if text is None:
        return None
    t = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    return format(d.normalize(), "f")


def extract_answer(reply: str) -> str | None:
    """Strict ``#### N`` first, then the last number of the reply."""
    m = STRICT.search(reply)
    if m:
        return normalize_number(m.group(1))
    numbers = NUMBER.findall(reply)
    return normalize_number(numbers[-1]) if numbers else None


def load_problems(path: Path, limit: int | None = None) -> list[Problem]:
    if not path.is_file():
        raise ConfigError(f"GSM8K file {str(path)!r} not found (a JSONL of question/answer lines)")
    out: list[Problem] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            gold = normalize_number(row["answer"].split("####")[-1])
            if gold is None:
                raise ConfigError(f"{path}: line {len(out) + 1} has no '#### N' answer")
            out.append(Problem(len(out), row["question"], row["answer"], gold))
            if limit is not None and len(out) >= limit:
                break
    return out


def build_messages(problem: Problem, shots: list[Problem]) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for s in shots:
        msgs.append({"role": "user", "content": s.question})
        msgs.append({"role": "assistant", "content": ANNOTATION.sub("", s.answer)})
    msgs.append({"role": "user", "content": problem.question})
    return msgs


def _record(problem: Problem, reply: Reply) -> dict:
    if not reply.ok:
        return {"id": problem.item_id, "error": reply.error}
    answer = extract_answer(reply.text)
    return {"id": problem.item_id, "reply": reply.text, "answer": answer, "gold": problem.gold,
            "correct": answer == problem.gold, "finish_reason": reply.finish_reason}


async def run(ctx: SuiteContext) -> SuiteResult:
    t0 = time.monotonic()
    s = ctx.settings
    if s.gsm8k_path is None:
        raise ConfigError("the gsm8k suite needs --gsm8k PATH (a JSONL of question/answer lines)")
    problems = load_problems(Path(s.gsm8k_path), s.gsm8k_limit)
    shots = load_problems(Path(s.gsm8k_fewshot_path), s.gsm8k_shots) if s.gsm8k_fewshot_path and s.gsm8k_shots else []
    aa_n = min(s.aa_items, len(problems))
    ctx.progress.total(NAME, 2 * len(problems) + aa_n)

    async def ask(client, p: Problem, sampling=None) -> dict:
        reply = await client.chat(build_messages(p, shots), sampling or ctx.sampling, s.gsm8k_max_tokens)
        ctx.progress.advance(NAME)
        return _record(p, reply)

    base, cand, aa = await asyncio.gather(
        asyncio.gather(*(ask(ctx.baseline, p) for p in problems)),
        asyncio.gather(*(ask(ctx.candidate, p) for p in problems)),
        asyncio.gather(*(ask(ctx.baseline, p) for p in problems[:aa_n])))
    base, cand = list(base), list(cand)
    aa_pairs = [(a, b) for a, b in zip(aa, base, strict=False) if "error" not in a and "error" not in b]
    disagreement = (sum(a["answer"] != b["answer"] for a, b in aa_pairs) / len(aa_pairs)) if aa_pairs else 0.0
    metrics: dict = {"questions": len(problems), "shots": len(shots),
                     "aa": {"items": len(aa_pairs), "disagreement": disagreement}}
    errors = sum(1 for b, c in zip(base, cand, strict=True) if "error" in b or "error" in c)
    metrics["errors"] = errors
    invalid = error_rate_reason(errors, len(problems), s.max_error_rate)
    if invalid:
        result = SuiteResult(NAME, Verdict.INVALID, invalid, metrics, base, cand)
    elif disagreement > s.aa_max_disagreement:
        result = await _sampled(ctx, problems, shots, base, cand, metrics, ask)
    else:
        result = _greedy_decision(ctx, base, cand, metrics, problems)
    result.wall_s = time.monotonic() - t0
    return result


def _worst(problems: list[Problem], base: list[dict], cand: list[dict]) -> list[dict]:
    losses = [(b, c) for b, c in zip(base, cand, strict=True) if b.get("correct") and c.get("correct") is False]
    return [{"id": b["id"], "question": problems[b["id"]].question[:300], "gold": b["gold"],
             "baseline": f"{b['answer']}: {b['reply'][-400:]}", "candidate": f"{c['answer']}: {c['reply'][-400:]}"}
            for b, c in losses[:5]]


def _greedy_decision(ctx: SuiteContext, base: list[dict], cand: list[dict], metrics: dict,
                     problems: list[Problem]) -> SuiteResult:
    s = ctx.settings
    pairs = [(b["correct"], c["correct"]) for b, c in zip(base, cand, strict=True)
             if "error" not in b and "error" not in c]
    table = PairedTable.from_pairs(pairs)
    one_sided = tango_interval(table, round(1 - 2 * (1 - s.confidence), 12))
    metrics.update(table=table.to_dict(), mcnemar_p=mcnemar_exact_p(table), lower_bound=one_sided.low,
                   margin=s.gsm8k_margin, intervals={
                       "tango": tango_interval(table, s.confidence).to_dict(),
                       "newcombe": newcombe_interval(table, s.confidence).to_dict(),
                       f"tango one-sided {s.confidence:.0%}": one_sided.to_dict()})
    decision = non_inferiority(one_sided.low, one_sided.high, s.gsm8k_margin)
    reason = (f"accuracy {100 * table.baseline_rate:.2f}% -> {100 * table.candidate_rate:.2f}% "
              f"({table.baseline_only} losses, {table.candidate_only} gains of {table.n}); one-sided "
              f"{s.confidence:.0%} Tango bounds [{100 * one_sided.low:+.2f}, {100 * one_sided.high:+.2f}] points "
              f"{_against_margin(decision, s.gsm8k_margin)}")
    return SuiteResult(NAME, Verdict(decision), reason, metrics, base, cand, _worst(problems, base, cand))


def _against_margin(decision: str, margin: float) -> str:
    if decision == "pass":
        return f"(lower >= -{100 * margin:g})"
    if decision == "fail":
        return f"(upper < -{100 * margin:g})"
    return f"straddle -{100 * margin:g}: too few questions to decide either way"


async def _sampled(ctx: SuiteContext, problems: list[Problem], shots: list[Problem], base: list[dict],
                   cand: list[dict], metrics: dict, ask) -> SuiteResult:
    s = ctx.settings
    k = s.gsm8k_samples
    ctx.progress.total(NAME, 2 * len(problems) * (k + 1) + min(s.aa_items, len(problems)))
    settings = [replace(ctx.sampling, temperature=s.gsm8k_sample_temperature, seed=ctx.sampling.seed + j + 1)
                for j in range(k)]
    runs = await asyncio.gather(*(asyncio.gather(*(ask(client, p, st) for p in problems))
                                  for client in (ctx.baseline, ctx.candidate) for st in settings))
    base_runs, cand_runs = runs[:k], runs[k:]
    diffs, errors = [], 0
    for i, (b, c) in enumerate(zip(base, cand, strict=True)):
        b_ok = [r[i]["correct"] for r in base_runs if "error" not in r[i]]
        c_ok = [r[i]["correct"] for r in cand_runs if "error" not in r[i]]
        errors += 2 * k - len(b_ok) - len(c_ok)
        b["samples_correct"], c["samples_correct"] = b_ok, c_ok
        if b_ok and c_ok:
            diffs.append(sum(c_ok) / len(c_ok) - sum(b_ok) / len(b_ok))
    invalid = error_rate_reason(errors, 2 * k * len(problems), s.max_error_rate)
    note = (f"greedy answers were not deterministic on the baseline (A/A disagreement "
            f"{100 * metrics['aa']['disagreement']:.1f}% > {100 * s.aa_max_disagreement:g}%): decided on {k} "
            f"sampled answers per question (temperature {s.gsm8k_sample_temperature:g}) with a question-level "
            f"paired bootstrap interval")
    if invalid or not diffs:
        return SuiteResult(NAME, Verdict.INVALID, invalid or "no question was answered by both", metrics,
                           base, cand, notes=[note])
    one_sided = bootstrap_mean_interval(diffs, round(1 - 2 * (1 - s.confidence), 12), seed=s.seed)
    mean = sum(diffs) / len(diffs)
    metrics.update(mode="sampled", samples=k, mean_difference=mean, lower_bound=one_sided.low,
                   margin=s.gsm8k_margin, intervals={
                       "question-level bootstrap": bootstrap_mean_interval(diffs, s.confidence, seed=s.seed).to_dict(),
                       f"question-level one-sided {s.confidence:.0%}": one_sided.to_dict()})
    decision = non_inferiority(one_sided.low, one_sided.high, s.gsm8k_margin)
    reason = (f"sampled mode: mean difference {100 * mean:+.2f} points; one-sided bounds "
              f"[{100 * one_sided.low:+.2f}, {100 * one_sided.high:+.2f}] {_against_margin(decision, s.gsm8k_margin)}")
    return SuiteResult(NAME, Verdict(decision), reason, metrics, base, cand, _worst(problems, base, cand),
                       notes=[note])


SUITES.register(NAME)(run)
