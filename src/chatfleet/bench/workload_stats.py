"""Statistics of a workload sample, printed by `chatfleet workload` and checked by the tests."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from chatfleet.bench.workload import Conversation, Workload  # or a traces.TraceWorkload


@dataclass(frozen=True)
class WorkloadStats:
    profile: str
    tokenizer: str
    conversations: int
    requests: int
    request_tokens_mean: float
    request_tokens_p50: float
    request_tokens_p95: float
    request_tokens_max: int
    card_tokens_mean: float
    user_tokens_mean: float
    reply_tokens_mean: float
    reply_tokens_max: int
    turns_mean: float
    think_time_s_mean: float
    distinct_cards: int
    top_card_share: float  # share of conversations on the most popular card
    languages: dict[str, float]  # share of conversations per language

    def to_dict(self) -> dict:
        return asdict(self)


def describe(workload: Workload, conversations: list[Conversation] | None = None, n: int = 400) -> WorkloadStats:
    """Stats over ``conversations`` (default: the first ``n`` of the workload)."""
    convs = conversations if conversations is not None else [workload.conversation(i) for i in range(n)]
    req = np.array([c.prompt_tokens(t) for c in convs for t in range(len(c.turns))], dtype=float)
    turns = [t for c in convs for t in c.turns]
    thinks = [t.think_time_s for c in convs for t in c.turns[1:]]
    card_use = Counter(c.character_id for c in convs)
    lang_of = {card.character_id: card.language for card in getattr(workload, "cards", [])}
    langs = Counter(lang_of.get(c.character_id, "?") for c in convs)
    return WorkloadStats(
        profile=workload.profile.name,
        tokenizer=workload.counter.name,
        conversations=len(convs),
        requests=int(req.size),
        request_tokens_mean=float(req.mean()),
        request_tokens_p50=float(np.percentile(req, 50)),
        request_tokens_p95=float(np.percentile(req, 95)),
        request_tokens_max=int(req.max()),
        card_tokens_mean=float(np.mean([c.system_tokens for c in convs])),
        user_tokens_mean=float(np.mean([t.user_tokens for t in turns])),
        reply_tokens_mean=float(np.mean([t.reply_tokens for t in turns])),
        reply_tokens_max=int(max(t.reply_tokens for t in turns)),
        turns_mean=float(np.mean([len(c.turns) for c in convs])),
        think_time_s_mean=float(np.mean(thinks)) if thinks else 0.0,
        distinct_cards=len(card_use),
        top_card_share=card_use.most_common(1)[0][1] / len(convs),
        languages={k: v / len(convs) for k, v in sorted(langs.items())},
    )
