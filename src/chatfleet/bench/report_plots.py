"""The report's plots, each returned with the one sentence that says what it shows.

Read at a glance: latency on linear axes in ms or s with the SLO drawn as a line, one colour and
one short label per series (``short_labels``: a URL becomes its host and port), whole-number load
axes for live chats and requests in flight, the knee marked, legends beside the axes rather than
over the lines. Read from a result document's series (``report.sweep_to_dict``).
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from chatfleet.bench.report_breakdown import figure as breakdown_figure
from chatfleet.bench.slo import SLOTarget, parse_slo
from chatfleet.errors import ConfigError

MAX_LABEL = 24
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")  # tab10: distinct for up to ten series
SLO_COLOUR = "#c00000"


@dataclass(frozen=True)
class Plot:
    key: str
    png_base64: str
    caption: str  # one sentence: what the plot shows


def short_labels(names: list[str]) -> dict[str, str]:
    """Legend labels: 'http://127.0.0.1:8000/v1' -> '127.0.0.1:8000'; long names cut; all distinct."""
    out: dict[str, str] = {}
    for name in names:
        label = name
        parts = urlsplit(name)
        if parts.scheme in ("http", "https") and parts.netloc:
            label = parts.netloc.rsplit("@", 1)[-1]
        if len(label) > MAX_LABEL:
            label = label[: MAX_LABEL - 1] + "…"
        base, k = label, 2
        while label in out.values():
            label, k = f"{base} ({k})", k + 1
        out[name] = label
    return out


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _targets(series: dict[str, dict]) -> list[SLOTarget]:
    for sw in series.values():
        try:
            return list(parse_slo(sw["slo"]).targets)
        except (ConfigError, KeyError):
            continue
    return []


def _integer_loads(series: dict[str, dict]) -> bool:
    return all(sw.get("mode") != "open" for sw in series.values())


def _finite(v: float | None) -> float:
    return v if v is not None and isinstance(v, (int, float)) and math.isfinite(v) else float("nan")


def _target_band(point: dict, key: str) -> tuple[float, float, float]:
    """(estimate, low, high) of a target at a point: the pooled interval if judged, else over repeats."""
    judged = (point.get("confidence") or {}).get("intervals", {}).get(key)
    if judged:
        return _finite(judged["estimate"]), _finite(judged["low"]), _finite(judged["high"])
    iv = point["intervals"].get(key) or {}
    return _finite(iv.get("mean")), _finite(iv.get("low")), _finite(iv.get("high"))


def _seconds_unit(values: list[float]) -> tuple[float, str]:
    top = max((v for v in values if v == v), default=0.0)
    return (1e3, "ms") if top < 2.0 else (1.0, "s")


def _style_load_axis(ax, integer: bool) -> None:
    from matplotlib.ticker import MaxNLocator

    if integer:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=2))
    ax.set_xlim(left=0)


def _legend_below(fig, axes) -> None:
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels and not lab.startswith("_"):
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False,
                   bbox_to_anchor=(0.5, -0.02))
        fig.subplots_adjust(bottom=0.22 + 0.05 * ((len(labels) - 1) // 4))


def _mark_points(ax, xs, ys, verdicts, colour) -> None:
    for x, y, v in zip(xs, ys, verdicts, strict=True):
        if v == "fail":
            ax.plot([x], [y], "x", color=colour, ms=9, mew=2)
        elif v == "undecided":
            ax.plot([x], [y], "o", mfc="white", mec=colour, ms=9, mew=1.5)


def latency_figure(series: dict[str, dict]):
    """One panel per SLO target; returns (figure, caption)."""
    import matplotlib.pyplot as plt

    targets = _targets(series)
    labels = short_labels(list(series))
    integer = _integer_loads(series)
    fig, axes = plt.subplots(1, max(1, len(targets)), figsize=(5.2 * max(1, len(targets)), 3.8), squeeze=False)
    for ax, t in zip(axes[0], targets, strict=False):
        bands = {n: [_target_band(p, t.key) for p in sw["points"]] for n, sw in series.items()}
        scale, unit = _seconds_unit([t.threshold_s] + [e for b in bands.values() for e, _, _ in b])
        for i, (name, sw) in enumerate(series.items()):
            colour = COLOURS[i % len(COLOURS)]
            xs = [p["level"] for p in sw["points"]]
            est = [e * scale for e, _, _ in bands[name]]
            ax.plot(xs, est, "-o", color=colour, ms=4, label=labels[name])
            ax.fill_between(xs, [lo * scale for _, lo, _ in bands[name]], [hi * scale for _, _, hi in bands[name]],
                            color=colour, alpha=0.15, lw=0)
            _mark_points(ax, xs, est, [p.get("verdict", "pass" if p["passed"] else "fail") for p in sw["points"]],
                         colour)
            if sw.get("knee"):
                ax.axvline(sw["knee"], color=colour, ls=":", lw=1.5)
        ax.axhline(t.threshold_s * scale, color=SLO_COLOUR, ls="--", lw=1.5, label="SLO")
        ax.annotate(f"SLO {t.threshold_s * scale:g} {unit}", (0.01, t.threshold_s * scale),
                    xycoords=("axes fraction", "data"), color=SLO_COLOUR, fontsize=8, va="bottom")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{t.metric.upper()} {t.stat}", fontsize=10)
        ax.set_xlabel(_load_label(series)), ax.set_ylabel(unit), ax.grid(alpha=0.3)
        _style_load_axis(ax, integer)
    _legend_below(fig, axes[0])
    names = ", ".join(f"{t.metric.upper()} {t.stat}" for t in targets) or "latency"
    caption = (f"{names} at each load level for each series (shaded: its 95% interval), against the SLO "
               "(red dashed line); dotted verticals mark each series' knee, x a point that broke the SLO and "
               "a hollow circle one still undecided.")
    return fig, caption


def _load_label(series: dict[str, dict]) -> str:
    modes = {sw.get("mode") for sw in series.values()}
    if modes == {"closed"}:
        return "live chats"
    if modes == {"open"}:
        return "new chats per second"
    if modes == {"concurrency"}:
        return "requests in flight"
    return "load"


def goodput_figure(series: dict[str, dict]):
    """Goodput against load with the knee; returns (figure, caption)."""
    import matplotlib.pyplot as plt

    labels = short_labels(list(series))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, (name, sw) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        xs = [p["level"] for p in sw["points"]]
        ys = [_finite(p["intervals"]["goodput"]["mean"]) for p in sw["points"]]
        ax.plot(xs, ys, "-o", color=colour, ms=4, label=labels[name])
        ax.fill_between(xs, [_finite(p["intervals"]["goodput"]["low"]) for p in sw["points"]],
                        [_finite(p["intervals"]["goodput"]["high"]) for p in sw["points"]], color=colour, alpha=0.15,
                        lw=0)
        _mark_points(ax, xs, ys, [p.get("verdict", "pass" if p["passed"] else "fail") for p in sw["points"]], colour)
        if sw.get("knee"):
            ax.axvline(sw["knee"], color=colour, ls=":", lw=1.5)
            ax.annotate(f"knee {sw['knee']:g}", (sw["knee"], 1 - 0.08 * (i + 1)), xycoords=("data", "axes fraction"),
                        color=colour, fontsize=8, ha="left", xytext=(3, 0), textcoords="offset points")
    ax.set_xlabel(_load_label(series))
    ax.set_ylabel("requests/s within the SLO")
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.set_title("Goodput", fontsize=10)
    _style_load_axis(ax, _integer_loads(series))
    _legend_below(fig, [ax])
    return fig, ("Requests per second that met every SLO target at each load level (shaded: "
                "95% interval over repeats); the dotted vertical is the knee, the highest load shown to meet the SLO.")


def clocks_figure(series: dict[str, dict]):
    """Clock samples of every run; returns (figure, caption)."""
    import matplotlib.pyplot as plt

    labels = short_labels(list(series))
    fig, ax = plt.subplots(figsize=(7, 3))
    for i, (name, sw) in enumerate(series.items()):
        t_off, xs, ys = 0.0, [], []
        for p in sw["points"]:
            for r in p["runs"]:
                samples = r["telemetry"]["samples"]
                xs += [t_off + s["t_s"] for s in samples]
                ys += [s["clock_mhz"] if s["clock_mhz"] is not None else float("nan") for s in samples]
                t_off += (samples[-1]["t_s"] if samples else 0.0) + 1.0
        ax.plot(xs, ys, ".", ms=3, color=COLOURS[i % len(COLOURS)], label=f"{labels[name]} ({_telemetry_source(sw)})")
    ax.set_xlabel("seconds of measurement (runs back to back)")
    ax.set_ylabel("MHz")
    ax.grid(alpha=0.3)
    ax.set_title("Clock during runs", fontsize=10)
    _legend_below(fig, [ax])
    return fig, ("The processor's clock sampled during every run, runs back to back: a dip "
                "means the machine throttled (runs under --clock-floor are set aside and measured again).")


def _telemetry_source(sw: dict) -> str:
    for p in sw["points"]:
        for r in p["runs"]:
            return r["telemetry"]["source"]
    return "none"


HITS_CAPTION = ("Prefix-cache hit rate (solid, left axis) and TTFT p50 (dashed, right axis) by turn of the "
                "conversation and by the user's pause before it, at each series' knee.")


def figures(series: dict[str, dict]) -> dict[str, tuple[object, str]]:
    """key -> (matplotlib figure, caption), in the report's order."""
    import matplotlib

    matplotlib.use("Agg")
    return {"latency": latency_figure(series), "goodput": goodput_figure(series),
            "hits": (breakdown_figure(series, short_labels(list(series))), HITS_CAPTION),
            "clocks": clocks_figure(series)}


def plots(series: dict[str, dict]) -> list[Plot]:
    return [Plot(key, _png(fig), caption) for key, (fig, caption) in figures(series).items()]
