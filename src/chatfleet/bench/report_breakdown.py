"""The report's view of a warm cache: hit rate and TTFT by turn index and by pause length.

Read from a result document's series (``sweep_to_dict``): for each series, the knee's load
point (else the highest one measured) with its repeats pooled (``PointResult.breakdown``).
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from chatfleet.bench.breakdown import Breakdown, GroupStats

if TYPE_CHECKING:  # matplotlib is imported only where a figure is drawn
    from matplotlib.lines import Line2D


def best_point(sweep: dict) -> dict | None:
    """The knee's point, else the highest load measured."""
    pts = sweep["points"]
    if not pts:
        return None
    return next((p for p in pts if p["level"] == sweep.get("knee")), pts[-1])


def series_breakdowns(series: dict[str, dict]) -> dict[str, tuple[float, Breakdown]]:
    """name -> (load level, breakdown) at each series' best point (results without one are skipped)."""
    out = {}
    for name, sw in series.items():
        p = best_point(sw)
        if p is not None and "breakdown" in p:
            out[name] = (p["level"], Breakdown.from_dict(p["breakdown"]))
    return out


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _ms(v: float | None) -> str:
    if v is None or v != v:
        return "-"
    return "inf" if v == float("inf") else f"{v * 1e3:.0f} ms"


def group_row(g: GroupStats) -> list[str]:
    """Cells of one group: key, requests, failed, hit rate (tokens), mean request hit rate, TTFT p50/p95."""
    return [g.key, str(g.requests), str(g.failed), _rate(g.hit_rate), _rate(g.request_hit_rate),
            _ms(g.ttft_p50), _ms(g.ttft_p95)]


GROUP_COLUMNS = ("requests", "failed", "hit rate", "mean req. hit rate", "ttft p50", "ttft p95")


def tables_html(series: dict[str, dict]) -> str:
    parts = []
    for name, (level, bd) in series_breakdowns(series).items():
        for title, groups in (("turn index", bd.by_turn), ("pause before the turn", bd.by_pause)):
            head = "".join(f"<th>{html.escape(c)}</th>" for c in (title, *GROUP_COLUMNS))
            rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in group_row(g)) + "</tr>"
                           for g in groups)
            parts.append(f"<h3>{html.escape(name)} at load {level:g}: by {html.escape(title)}</h3>"
                         f"<table><tr>{head}</tr>{rows}</table>")
    return "".join(parts)


def figure(series: dict[str, dict], labels: dict[str, str] | None = None):
    """Two panels (by turn, by pause), each hit rate (solid) and TTFT p50 (dashed, right axis), one
    colour per series, one legend under both panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or {n: n for n in series}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    fig.subplots_adjust(wspace=0.35)
    found = series_breakdowns(series)
    p50s = [g.ttft_p50 for _, bd in found.values() for g in (*bd.by_turn, *bd.by_pause)
            if g.ttft_p50 is not None and g.ttft_p50 != float("inf")]
    scale, unit = (1e3, "ms") if max(p50s, default=0.0) < 2.0 else (1.0, "s")
    handles: list[Line2D] = []
    for ax, attr, xlabel in ((axes[0], "by_turn", "turn index in the conversation"),
                             (axes[1], "by_pause", "pause before the turn")):
        twin = ax.twinx()
        orders = {g.key: g.order for _, bd in found.values() for g in getattr(bd, attr)}
        keys = sorted(orders, key=orders.__getitem__)  # one x axis for every series
        handles = []
        for i, (name, (level, bd)) in enumerate(found.items()):
            groups = getattr(bd, attr)
            xs = [keys.index(g.key) for g in groups]
            handles += ax.plot(xs, [g.hit_rate if g.hit_rate is not None else float("nan") for g in groups], "-o",
                               color=f"C{i}", ms=4, label=f"{labels.get(name, name)} hit rate (load {level:g})")
            ttft = [g.ttft_p50 * scale if g.ttft_p50 is not None and g.ttft_p50 != float("inf") else float("nan")
                    for g in groups]
            handles += twin.plot(xs, ttft, "--s", color=f"C{i}", ms=4, alpha=0.7,
                                 label=f"{labels.get(name, name)} TTFT p50")
        ax.set_xticks(range(len(keys)), keys, rotation=30 if attr == "by_pause" else 0, fontsize=7)
        ax.set_xlabel(xlabel), ax.set_ylabel("prefix-cache hit rate"), ax.set_ylim(0, 1.02), ax.grid(alpha=0.3)
        twin.set_ylabel(f"TTFT p50 ({unit})")
        twin.set_ylim(bottom=0)
    axes[0].set_title("By turn", fontsize=10), axes[1].set_title("By pause", fontsize=10)
    if handles:
        fig.legend(handles, [str(h.get_label()) for h in handles], loc="lower center", ncol=min(4, len(handles)),
                   fontsize=8, frameon=False, bbox_to_anchor=(0.5, -0.02))
        fig.subplots_adjust(bottom=0.28)
    return fig
