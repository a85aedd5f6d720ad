"""Role-play likelihood: does the candidate still find stock's own replies as likely as stock does?

For each of the bench's multilingual role-play conversations (card, scripted history, a new
user turn), the chat prompt is turned into token ids once, by the baseline's ``/tokenize``, and
frozen: both servers see exactly those ids. The baseline answers greedily through
``/v1/completions`` (token-id prompt, logprobs returned as token ids, so the reply's ids are
exact). Both servers then score prompt + reply with ``echo`` and ``logprobs`` (the echoed ids
are checked against what was sent); the reply tokens' negative log-likelihoods give a per-token
dNLL = NLL(candidate) - NLL(baseline). The decision (``stats.equivalence``): pass where the
bootstrap interval (over conversations) of the mean per-token dNLL lies within +-margin, fail
where it lies wholly outside, inconclusive where it straddles the margin.

The candidate's own greedy replies are checked for language mismatch, termination (hit
max_tokens) and looping; paired new-failure counts are reported beside the decision.
The A/A check: the baseline scores the first few sequences a second time; if its own scores
move by more than half the margin, the measurement is too noisy to decide (invalid).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from chatfleet.bench.tokens import EstimateCounter
from chatfleet.bench.workload import Workload, get_profile
from chatfleet.gate.client import GateClient, Reply
from chatfleet.gate.reply_checks import check_reply
from chatfleet.gate.stats import PairedTable, bootstrap_ratio_interval, equivalence
from chatfleet.gate.suite import SUITES, SuiteContext, SuiteResult, Verdict, error_rate_reason

NAME = "roleplay"
CHECKS = ("language_mismatch", "hit_max_tokens", "looping")


@dataclass(frozen=True)
class Prompt:
    item_id: int
    language: str
    messages: list[dict]


def conversations(ctx: SuiteContext) -> list[Prompt]:
    """The bench's conversations, each cut at its third turn (or its last) with scripted history."""
    s = ctx.settings
    work = Workload(get_profile(s.roleplay_profile), s.seed, EstimateCounter(), scripted_replies=True)
    out = []
    for i in range(s.roleplay_conversations):
        conv = work.conversation(i)
        turn = min(2, len(conv.turns) - 1)
        out.append(Prompt(i, work.cards[conv.character_id].language, conv.messages(turn)))
    return out


def reply_nll(scored: Reply, sequence: list[int], prompt_len: int) -> list[float] | str:
    """Negative log-likelihoods of the reply tokens, after checking the echoed ids."""
    if not scored.ok:
        return scored.error or "error"
    echoed = (scored.token_ids or [])[: len(sequence)]
    if echoed != sequence:
        return "the echoed token ids differ from the ids sent"
    lps = [lp for lp in scored.token_logprobs[prompt_len: len(sequence)] if lp is not None]
    if len(lps) != len(sequence) - prompt_len:  # short, or some token without a logprob
        return "the echo has no logprob for some reply token"
    return [-float(lp) for lp in lps]


async def _score(client: GateClient, ctx: SuiteContext, sequence: list[int]) -> Reply:
    return await client.complete_ids(sequence, ctx.sampling, 1, echo=True)


async def _one(ctx: SuiteContext, p: Prompt, aa: bool) -> tuple[dict, dict]:
    base_item: dict = {"id": p.item_id, "language": p.language}
    cand_item: dict = {"id": p.item_id, "language": p.language}
    max_tokens = ctx.settings.roleplay_max_tokens
    ids = await ctx.baseline.tokenize_chat(p.messages)
    if isinstance(ids, str):
        base_item["error"] = cand_item["error"] = f"tokenize: {ids}"
        return base_item, cand_item
    base_item["prompt_ids"] = ids
    base_gen, cand_gen = await asyncio.gather(ctx.baseline.complete_ids(ids, ctx.sampling, max_tokens),
                                              ctx.candidate.complete_ids(ids, ctx.sampling, max_tokens))
    for item, gen in ((base_item, base_gen), (cand_item, cand_gen)):
        if not gen.ok:
            item["error"] = f"generate: {gen.error}"
            continue
        reply_ids = gen.token_ids or []
        item.update(reply=gen.text, reply_ids=reply_ids, finish_reason=gen.finish_reason,
                    failures=check_reply(gen.text, reply_ids, gen.finish_reason, p.language).to_dict())
    if "error" in base_item:
        cand_item.setdefault("error", "no baseline reply to score")
        return base_item, cand_item
    sequence = ids + base_item["reply_ids"]
    jobs = [_score(ctx.baseline, ctx, sequence), _score(ctx.candidate, ctx, sequence)]
    if aa:
        jobs.append(_score(ctx.baseline, ctx, sequence))
    scored = await asyncio.gather(*jobs)
    nll = [reply_nll(s, sequence, len(ids)) for s in scored]
    for item, value in ((base_item, nll[0]), (cand_item, nll[1])):
        if isinstance(value, str):
            item["score_error"] = value
        else:
            item["nll"] = value
    if aa:
        base_item["aa_nll"] = nll[2] if not isinstance(nll[2], str) else None
    return base_item, cand_item


async def run(ctx: SuiteContext) -> SuiteResult:
    t0 = time.monotonic()
    s = ctx.settings
    prompts = conversations(ctx)
    ctx.progress.total(NAME, len(prompts))

    async def one(i: int, p: Prompt) -> tuple[dict, dict]:
        out = await _one(ctx, p, aa=i < s.aa_items)
        ctx.progress.advance(NAME)
        return out

    pairs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    base_items = [b for b, _ in pairs]
    cand_items = [c for _, c in pairs]
    result = decide(ctx, base_items, cand_items)
    result.wall_s = time.monotonic() - t0
    return result


def decide(ctx: SuiteContext, base_items: list[dict], cand_items: list[dict]) -> SuiteResult:
    s = ctx.settings
    errors = sum(1 for b, c in zip(base_items, cand_items, strict=True)
                 if "error" in b or "error" in c or "score_error" in b or "score_error" in c)
    scored = [(b, c) for b, c in zip(base_items, cand_items, strict=True) if "nll" in b and "nll" in c and b["nll"]]
    nums = [sum(c["nll"]) - sum(b["nll"]) for b, c in scored]
    dens = [len(b["nll"]) for b, _ in scored]
    for b, c in scored:
        b["mean_nll"] = sum(b["nll"]) / len(b["nll"])
        c["mean_nll"] = sum(c["nll"]) / len(c["nll"])
        c["dnll"] = c["mean_nll"] - b["mean_nll"]
    metrics: dict = {"conversations": len(base_items), "scored": len(scored), "errors": errors,
                     "reply_tokens": sum(dens), "margin": s.roleplay_margin}
    failures = {}
    for check in CHECKS:
        both = [(b["failures"][check], c["failures"][check]) for b, c in zip(base_items, cand_items, strict=True)
                if "failures" in b and "failures" in c]
        # "right" here means "has no failure", so the table's gains/losses read as fixed/new failures
        table = PairedTable.from_pairs([(not x, not y) for x, y in both])
        failures[check] = {"baseline": sum(x for x, _ in both), "candidate": sum(y for _, y in both),
                           "new": table.baseline_only, "fixed": table.candidate_only, "n": table.n}
    metrics["failures"] = failures
    worst = sorted((c for _, c in scored), key=lambda c: -abs(c["dnll"]))[:5]
    rows = [{"id": c["id"], "language": c["language"], "dnll": round(c["dnll"], 4),
             "baseline": base_items[c["id"]].get("reply", ""), "candidate": c.get("reply", "")} for c in worst]
    notes = ["language, termination and looping are reported as paired new-failure counts; "
             "the decision is on the likelihood interval"]
    invalid = error_rate_reason(errors, len(base_items), s.max_error_rate)
    if not scored:
        invalid = invalid or "no conversation could be scored"
    aa = [(b["aa_nll"], b["nll"]) for b, _ in scored if b.get("aa_nll")]
    if aa:
        aa_interval = bootstrap_ratio_interval([sum(x) - sum(y) for x, y in aa], [len(y) for _, y in aa],
                                               s.confidence, seed=s.seed)
        mean_dnll = sum(sum(x) - sum(y) for x, y in aa) / sum(len(y) for _, y in aa)
        metrics["aa"] = {"items": len(aa), "mean_dnll": mean_dnll, "interval": aa_interval.to_dict()}
        if max(abs(aa_interval.low), abs(aa_interval.high)) > s.roleplay_margin / 2:
            invalid = invalid or (f"A/A: the baseline's own scores of the same tokens moved by up to "
                                  f"{max(abs(aa_interval.low), abs(aa_interval.high)):.4f} nats/token, "
                                  f"more than half the margin")
    if invalid:
        return SuiteResult(NAME, Verdict.INVALID, invalid, metrics, base_items, cand_items, rows, notes)
    mean = sum(nums) / sum(dens) if sum(dens) else 0.0
    interval = bootstrap_ratio_interval(nums, dens, s.confidence, seed=s.seed)
    metrics.update(mean_dnll=mean, interval=interval.to_dict())
    decision = equivalence(interval.low, interval.high, s.roleplay_margin)
    where = {"pass": "within", "fail": "outside", "inconclusive": "straddling"}[decision]
    reason = (f"mean dNLL {mean:+.4f} nats/token, {interval.confidence:.0%} bootstrap interval "
              f"[{interval.low:+.4f}, {interval.high:+.4f}] {where} +-{s.roleplay_margin:g}")
    return SuiteResult(NAME, Verdict(decision), reason, metrics, base_items, cand_items, rows, notes)


SUITES.register(NAME)(run)
