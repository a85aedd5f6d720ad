"""Results: a JSON file with every run's settings and raw per-request records, and an HTML
report with plots (latency percentiles and goodput vs load with the knee, hit rate by turn,
clocks). Plots compare several series (e.g. the demo's stock and tuned engines)."""

from __future__ import annotations

import html
import json
import math
import time
from pathlib import Path

from chatfleet.bench.knee import knee_bracket, knee_spread
from chatfleet.bench.point_verdict import why_undecided
from chatfleet.bench.quantile_ci import StatInterval
from chatfleet.bench.report_breakdown import tables_html as breakdown_tables
from chatfleet.bench.report_plots import plots
from chatfleet.bench.run_agreement import disagreement
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.sweep import SweepResult
from chatfleet.errors import ConfigError

FORMAT_VERSION = 1


def sweep_to_dict(res: SweepResult, with_records: bool = True) -> dict:
    return {"mode": res.mode, "slo": res.slo, "knee": res.knee, "knee_reached": res.knee_reached,
            "out_of_budget": res.out_of_budget, "knee_spread": knee_spread(res.points).to_dict(),
            "knee_bracket": knee_bracket(res.points, res.knee).to_dict(),
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


def _seconds(v: float) -> str:
    if v != v:
        return "-"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v * 1e3:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"


VERDICT_CELLS = {"pass": "met", "fail": "<b>broken</b>", "undecided": "<i>undecided</i>"}


def _points_table(name: str, sw: dict, why_no_knee: str | None = None) -> str:
    """One row per load point: its verdict, runs, and each figure with its interval; for a judged
    point each SLO target as estimate [interval] over n requests; the undecided ones explained."""
    keys = [k for k in (sw["points"][0]["intervals"] if sw["points"] else {}) if k not in ("request_rate",)]
    targets = {t.key: t for t in parse_slo(sw["slo"]).targets} if sw.get("slo") else {}
    judged = any(p.get("confidence") for p in sw["points"])
    cols = ["load", "SLO", "runs", "set aside", *keys]
    if judged:
        cols += [f"{k} (pooled, n)" for k in targets]
    head = "".join(f"<th>{html.escape(k)}</th>" for k in cols)
    rows, notes = [], []
    for p in sw["points"]:
        verdict = p.get("verdict") or ("pass" if p["passed"] else "fail")
        extended = sum(bool(r.get("extension")) for r in p["runs"])
        runs = str(len(p["runs"])) + (f" ({extended} to decide)" if extended else "")
        cells = [f"{p['level']:g}", VERDICT_CELLS[verdict], runs, str(sum(r["throttled"] for r in p["runs"]))]
        for k in keys:
            iv = p["intervals"].get(k)  # a point where no run reported a hit rate has none
            cells.append("-" if iv is None else f"{iv['mean']:.4g} [{iv['low']:.3g}, {iv['high']:.3g}]")
        conf = p.get("confidence") or {}
        for k in targets if judged else ():
            d = conf.get("intervals", {}).get(k)
            if d is None:
                cells.append("-")
                continue
            iv = StatInterval.from_dict(d)
            cells.append(f"{_seconds(iv.estimate)} [{_seconds(iv.low)}, {_seconds(iv.high)}] n={iv.n}")
            if conf.get("targets", {}).get(k) == "undecided":
                notes.append(f"load {p['level']:g}: {why_undecided(targets[k], iv)}")
        alone = [r.get("verdict", "undecided") for r in conf.get("runs") or ()]
        if why := disagreement(verdict, conf.get("pooled"), alone):
            notes.append(f"load {p['level']:g}: {why}")
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    knee = sw.get("knee")
    knee_txt = f"none ({why_no_knee or 'no load was shown to meet the SLO'})" if knee is None else f"{knee:g}" + (
        "" if sw.get("knee_reached") else " (not reached: the sweep's time budget ran out)" if sw.get("out_of_budget")
        else " (not reached: the sweep's maximum still met the SLO)")
    bracket = sw.get("knee_bracket")
    if bracket:
        high = "open above" if bracket.get("high") is None else f"{bracket['high']:g}"
        knee_txt += f"; bracket {bracket['low']:g}-{high}" + (
            f" (undecided at {', '.join(f'{u:g}' for u in bracket['undecided'])})" if bracket.get("undecided") else "")
    spread = sw.get("knee_spread") or {}
    if len(spread.get("knees") or ()) > 1:
        knee_txt += f"; per repeat {spread['low']:g}-{spread['high']:g}"
    explain = ""
    if judged:
        level = next((d["level"] for p in sw["points"]
                      for d in (p.get("confidence") or {}).get("intervals", {}).values()), 0.95)
        explain = (f"<p>A point meets the SLO only where every target's {level:.0%} interval (order statistics over "
                   "the point's requests pooled) lies within it and no run judged on its own requests shows it broken "
                   "(broken likewise: no run alone shown met; otherwise the runs disagree); an undecided point was "
                   "measured again, and no knee is called on one.</p>")
    if notes:
        explain += "<ul>" + "".join(f"<li>undecided at {html.escape(n)}</li>" for n in notes) + "</ul>"
    return (f"<h3>{html.escape(name)}: knee {knee_txt}</h3><table><tr>{head}</tr>{''.join(rows)}</table>{explain}")


def _machine_and_ratio(doc: dict) -> str:
    """The machine the result was measured on and, for the demo, tuned's knee over stock's."""
    out = ""
    m = doc.get("machine")
    if m:
        load = " ".join(f"{x:.2f}" for x in m.get("load_average") or ())
        after = " ".join(f"{x:.2f}" for x in m.get("load_average_after") or ())
        out += (f"<p>Machine: {html.escape(str(m.get('cpu_model')))}, {m.get('logical_cpus')} CPUs; load average "
                f"{load} at the start" + (f", {after} at the end" if after else "") + "</p>")
        other = m.get("other_work") or {}
        if other:
            shares = "; ".join(f"{html.escape(n)} {u['others_share']:.0%} ({u.get('contending_share', 0):.0%} at "
                               "normal priority)" for n, u in other.items())
            flag = ("<b>DISTURBED</b>: the ratio's range does not cover other work on the machine"
                    if m.get("disturbed") else "quiet")
            out += f"<p>Other work's share of the CPUs during each series: {shares} ({flag}).</p>"
    r = doc.get("ratio")
    if r:
        t = r.get("tuned_over_stock")
        if t:
            high = "unbounded" if t.get("high") is None else f"{t['high']:.2f}x"
            over = ("the knees' brackets" if t.get("range_from") == "knee brackets"
                    else "the knees' spreads over repeats")
            out += (f"<p><b>tuned / stock: {t['value']:.2f}x</b> the live chats inside the SLO (range "
                    f"{t['low']:.2f}x-{high} from {over})</p>")
        else:
            out += f"<p><b>No tuned / stock ratio</b>: {html.escape(str(r.get('why_none')))}.</p>"
    return out


def render_html(doc: dict) -> str:
    series = doc["series"]
    imgs = plots(series) if any(sw["points"] for sw in series.values()) else []
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
    knees = doc.get("knees") or {}
    tables = "".join(_points_table(n, sw, (knees.get(n) or {}).get("why_none")) for n, sw in series.items())
    figs = "".join(f'<figure><img src="data:image/png;base64,{p.png_base64}" alt="{p.key}">'
                   f"<figcaption>{html.escape(p.caption)}</figcaption></figure>" for p in imgs)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>chatfleet {html.escape(doc['kind'])}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px}}img{{max-width:100%}}
figure{{margin:1.5em 0}}figcaption{{font-size:14px;color:#333;max-width:800px}}
pre{{background:#f6f6f6;padding:1em}}</style>
</head><body><h1>chatfleet {html.escape(doc['kind'])}</h1>
<p>SLO: <code>{html.escape(next(iter(series.values()))['slo'] if series else '')}</code>. Loads are
{html.escape(next(iter(series.values()))['mode'] if series else '')}-loop levels; intervals are 95% over repeats.</p>
{_machine_and_ratio(doc)}{fleet}{tables}{figs}<h2>Warm cache: hit rate and TTFT by turn and by pause</h2>
<p>Hit rate per request is <code>usage.prompt_tokens_details.cached_tokens / prompt_tokens</code> as the
server reported it; "hit rate" weights requests by their prompt tokens.</p>{breakdown_tables(series)}
<h2>Settings</h2><pre>{settings}</pre></body></html>"""


def write_html(doc: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(doc), encoding="utf-8")
    return path
