"""Hit rate and TTFT by turn index and by pause length: where a warm cache pays off.

A returning turn finds its history in the prefix cache only if nothing evicted it while the
user paused, so the numbers that tell engines apart are per turn and per pause, not the run's
average. Each request's hit rate is ``usage.prompt_tokens_details.cached_tokens / prompt_tokens``
as the server reports it. A group reports the token-weighted hit rate (cached / prompt tokens
over the group), the mean of the per-request rates, and TTFT percentiles; a failed request
counts as infinitely slow, as in ``stats.summarize``.

Pauses fall into bins of doubling width (``PAUSE_EDGES_S``); a conversation's first turn has no
pause and gets its own bin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from chatfleet.bench.records import RequestRecord
from chatfleet.bench.slo import stat_of

PAUSE_EDGES_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
FIRST_TURN = "first turn"


@dataclass(frozen=True)
class GroupStats:
    """One turn index or pause bin."""

    key: str
    order: float  # sort key (turn index, or the bin's lower edge; the first-turn bin is -1)
    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float | None  # cached / prompt tokens over the group's requests that reported usage
    request_hit_rate: float | None  # mean of the per-request rates
    ttft_p50: float | None
    ttft_p95: float | None
    ttft_mean: float | None  # over ok requests only

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GroupStats:
        return cls(**d)


def request_hit_rate(rec: RequestRecord) -> float | None:
    """``cached_tokens / prompt_tokens`` of one request; None when the server did not report them."""
    if rec.status != "ok" or not rec.prompt_tokens or rec.cached_tokens is None:
        return None
    return rec.cached_tokens / rec.prompt_tokens


def pause_bin(pause_s: float | None) -> tuple[str, float]:
    """(label, lower edge) of the bin a pause falls in; ``None`` or a first turn -> FIRST_TURN."""
    if pause_s is None:
        return FIRST_TURN, -1.0
    lo = 0.0
    for edge in PAUSE_EDGES_S:
        if pause_s < edge:
            return f"{_fmt(lo)}-{_fmt(edge)}s", lo
        lo = edge
    return f">={_fmt(lo)}s", lo


def _fmt(x: float) -> str:
    return f"{x:g}"


def _group(key: str, order: float, recs: list[RequestRecord]) -> GroupStats:
    inf = float("inf")
    ttfts = [r.ttft_s if r.status == "ok" and r.ttft_s is not None else inf for r in recs]
    ok_ttfts = [t for t in ttfts if t != inf]
    rates = [h for h in (request_hit_rate(r) for r in recs) if h is not None]
    reported = [r for r in recs if request_hit_rate(r) is not None]
    prompt = sum(r.prompt_tokens or 0 for r in reported)  # both reported (request_hit_rate)
    cached = sum(r.cached_tokens or 0 for r in reported)
    return GroupStats(
        key=key,
        order=order,
        requests=len(recs),
        failed=sum(r.status != "ok" for r in recs),
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=cached / prompt if prompt else None,
        request_hit_rate=sum(rates) / len(rates) if rates else None,
        ttft_p50=stat_of(ttfts, "p50") if ttfts else None,
        ttft_p95=stat_of(ttfts, "p95") if ttfts else None,
        ttft_mean=sum(ok_ttfts) / len(ok_ttfts) if ok_ttfts else None,
    )


def group_by(records: Iterable[RequestRecord], key: Callable[[RequestRecord], tuple[str, float]]) -> list[GroupStats]:
    """Stats per group of the measured (non-warmup) records, ordered by the group's sort key."""
    groups: dict[str, tuple[float, list[RequestRecord]]] = {}
    for r in records:
        if r.warmup:
            continue
        label, order = key(r)
        groups.setdefault(label, (order, []))[1].append(r)
    return sorted((_group(k, o, rs) for k, (o, rs) in groups.items()), key=lambda g: g.order)


def by_turn(records: Iterable[RequestRecord]) -> list[GroupStats]:
    return group_by(records, lambda r: (str(r.turn), float(r.turn)))


def by_pause(records: Iterable[RequestRecord]) -> list[GroupStats]:
    return group_by(records, lambda r: pause_bin(r.pause_s if r.turn > 0 else None))


@dataclass(frozen=True)
class Breakdown:
    """Per-turn and per-pause stats of one run or of one load point's repeats pooled."""

    by_turn: list[GroupStats]
    by_pause: list[GroupStats]

    def to_dict(self) -> dict:
        return {"by_turn": [g.to_dict() for g in self.by_turn], "by_pause": [g.to_dict() for g in self.by_pause]}

    @classmethod
    def from_dict(cls, d: dict) -> Breakdown:
        return cls([GroupStats.from_dict(g) for g in d.get("by_turn", [])],
                   [GroupStats.from_dict(g) for g in d.get("by_pause", [])])


def breakdown(records: Iterable[RequestRecord]) -> Breakdown:
    recs = list(records)
    return Breakdown(by_turn(recs), by_pause(recs))
