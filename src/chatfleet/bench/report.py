"""Results: a JSON file with every run's settings and raw per-request records, and an HTML
report with plots (latency percentiles and goodput vs load with the knee, hit rate by turn,
clocks). Plots compare several series (e.g. the demo's stock and tuned engines)."""

from __future__ import annotations

import base64
import html
import io
import json
import time
from pathlib import Path

from chatfleet.bench.knee import knee_spread
from chatfleet.bench.report_breakdown import figure as breakdown_figure
from chatfleet.bench.report_breakdown import tables_html as breakdown_tables
from chatfleet.bench.sweep import SweepResult
from chatfleet.errors import ConfigError

FORMAT_VERSION = 1


def sweep_to_dict(res: SweepResult, with_records: bool = True) -> dict:
    return {"mode": res.mode, "slo": res.slo, "knee": res.knee, "knee_reached": res.knee_reached,
            "knee_spread": knee_spread(res.points).to_dict(),
            "points": [p.to_dict(with_records) for p in res.points]}


def result_document(kind: str, settings: dict, series: dict[str, dict], extra: dict | None = None) -> dict:
    """The JSON result: ``series`` maps a name (server or engine config) to its sweep dict."""
    return {"format": "chatfleet.bench", "version": FORMAT_VERSION, "kind": kind, "created_unix": time.time(),
            "settings": settings, "series": series, **(extra or {})}


def write_json(doc: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, ensure_ascii=False, allow_nan=True, default=str))
    return path


def load_result(path: str | Path) -> dict:
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read result {p}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != "chatfleet.bench" or "series" not in doc:
        raise ConfigError(f"{p} is not a chatfleet bench result (no 'format: chatfleet.bench')")
    return doc


# -- plots -------------------------------------------------------------------------------

def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _point_stat(point: dict, metric: str, stat: str) -> float:
    vals = [r["summary"]["latency"][metric][stat] for r in point["runs"] if not r["throttled"]] or \
           [r["summary"]["latency"][metric][stat] for r in point["runs"]]
    finite = [v for v in vals if v is not None and v == v and v != float("inf")]
    return sum(finite) / len(finite) if finite else float("nan")


def plots(series: dict[str, dict]) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, sw) in enumerate(series.items()):
        xs = [p["level"] for p in sw["points"]]
        for metric, stat, style in (("ttft", "p99", "-o"), ("itl", "p99", "--s"), ("reply", "p95", ":^")):
            ax.plot(xs, [_point_stat(p, metric, stat) for p in sw["points"]], style, color=f"C{i}",
                    label=f"{name} {metric} {stat}")
    ax.set_xlabel("load"), ax.set_ylabel("seconds"), ax.set_yscale("log"), ax.grid(alpha=0.3)
    ax.set_title("Latency percentiles vs load"), ax.legend(fontsize=7)
    out["latency"] = _png(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, sw) in enumerate(series.items()):
        xs = [p["level"] for p in sw["points"]]
        ys = [p["intervals"]["goodput"]["mean"] for p in sw["points"]]
        lows = [p["intervals"]["goodput"]["low"] for p in sw["points"]]
        highs = [p["intervals"]["goodput"]["high"] for p in sw["points"]]
        line = ax.plot(xs, ys, "-o", label=f"{name} goodput")[0]
        ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.15)
        for p in sw["points"]:
            if not p["passed"]:
                ax.plot([p["level"]], [p["intervals"]["goodput"]["mean"]], "x", color=line.get_color(), ms=9)
        if sw.get("knee"):
            ax.axvline(sw["knee"], color=line.get_color(), ls="--", alpha=0.7)
            ax.annotate(f"knee {sw['knee']:g}", (sw["knee"], max(ys) * (0.9 - 0.1 * i) if ys else 0),
                        color=line.get_color(), fontsize=8)
    ax.set_xlabel("load"), ax.set_ylabel("requests/s meeting the SLO"), ax.grid(alpha=0.3)
    ax.set_title("Goodput vs load (x: SLO broken, dashed: knee)"), ax.legend(fontsize=7)
    out["goodput"] = _png(fig)

    out["hits"] = _png(breakdown_figure(series))

    fig, ax = plt.subplots(figsize=(7, 3))
    for name, sw in series.items():
        t_off, xs, ys = 0.0, [], []
        for p in sw["points"]:
            for r in p["runs"]:
                samples = r["telemetry"]["samples"]
                xs += [t_off + s["t_s"] for s in samples]
                ys += [s["clock_mhz"] if s["clock_mhz"] is not None else float("nan") for s in samples]
                t_off += (samples[-1]["t_s"] if samples else 0.0) + 1.0
        ax.plot(xs, ys, ".", ms=3, label=f"{name} ({_telemetry_source(sw)})")
    ax.set_xlabel("seconds of measurement (runs back to back)"), ax.set_ylabel("MHz"), ax.grid(alpha=0.3)
    ax.set_title("Clock during runs"), ax.legend(fontsize=7)
    out["clocks"] = _png(fig)
    return out


def _telemetry_source(sw: dict) -> str:
    for p in sw["points"]:
        for r in p["runs"]:
            return r["telemetry"]["source"]
    return "none"


def _points_table(name: str, sw: dict) -> str:
    keys = [k for k in (sw["points"][0]["intervals"] if sw["points"] else {}) if k not in ("request_rate",)]
    head = "".join(f"<th>{html.escape(k)}</th>" for k in ["load", "passed", "runs", "set aside", *keys])
    rows = []
    for p in sw["points"]:
        cells = [f"{p['level']:g}", "yes" if p["passed"] else "<b>no</b>", str(len(p["runs"])),
                 str(sum(r["throttled"] for r in p["runs"]))]
        for k in keys:
            iv = p["intervals"].get(k)  # a point where no run reported a hit rate has none
            cells.append("-" if iv is None else f"{iv['mean']:.4g} [{iv['low']:.3g}, {iv['high']:.3g}]")
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    knee = sw.get("knee")
    knee_txt = "none (the lowest load broke the SLO)" if knee is None else f"{knee:g}" + (
        "" if sw.get("knee_reached") else " (not reached: the sweep's maximum still met the SLO)")
    spread = sw.get("knee_spread") or {}
    if len(spread.get("knees") or ()) > 1:
        knee_txt += f"; per repeat {spread['low']:g}-{spread['high']:g}"
    return (f"<h3>{html.escape(name)}: knee {knee_txt}</h3><table><tr>{head}</tr>{''.join(rows)}</table>")


def render_html(doc: dict) -> str:
    series = doc["series"]
    imgs = plots(series) if any(sw["points"] for sw in series.values()) else {}
    settings = html.escape(json.dumps(doc.get("settings", {}), indent=2, ensure_ascii=False, default=str))
    fleet = ""
    if doc.get("fleet"):
        def cost(f: dict) -> str:
            c = f["cost_per_conversation_hour"]
            return "" if c is None else f"{c:.4f}"

        rows = "".join(
            f"<tr><td>{html.escape(n)}</td><td>{f['knee']:g}</td><td>{f['peak_chats']}</td><td>{f['replicas']}</td>"
            f"<td>{f['gpus']}</td><td>{cost(f)}</td></tr>"
            for n, f in doc["fleet"].items() if f)
        fleet = ("<h2>Fleet</h2><table><tr><th>series</th><th>knee (chats/replica)</th><th>peak chats</th>"
                 f"<th>replicas</th><th>GPUs</th><th>cost per conversation-hour</th></tr>{rows}</table>")
    tables = "".join(_points_table(n, sw) for n, sw in series.items())
    figs = "".join(f'<div><img src="data:image/png;base64,{b}" alt="{k}"></div>' for k, b in imgs.items())
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>chatfleet {html.escape(doc['kind'])}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px}}img{{max-width:100%}}pre{{background:#f6f6f6;padding:1em}}</style>
</head><body><h1>chatfleet {html.escape(doc['kind'])}</h1>
<p>SLO: <code>{html.escape(next(iter(series.values()))['slo'] if series else '')}</code>. Loads are
{html.escape(next(iter(series.values()))['mode'] if series else '')}-loop levels; intervals are 95% over repeats.</p>
{fleet}{tables}{figs}<h2>Warm cache: hit rate and TTFT by turn and by pause</h2>
<p>Hit rate per request is <code>usage.prompt_tokens_details.cached_tokens / prompt_tokens</code> as the
server reported it; "hit rate" weights requests by their prompt tokens.</p>{breakdown_tables(series)}
<h2>Settings</h2><pre>{settings}</pre></body></html>"""


def write_html(doc: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(doc), encoding="utf-8")
    return path
