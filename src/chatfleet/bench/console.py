"""Terminal output: progress bars during runs and rich tables of results."""

from __future__ import annotations

import contextlib
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table

from chatfleet.bench.breakdown import Breakdown
from chatfleet.bench.fleet import FleetPlan
from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.point_sizing import values_to_decide_point
from chatfleet.bench.point_verdict import why_undecided
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.report_breakdown import GROUP_COLUMNS, group_row
from chatfleet.bench.run_agreement import disagreement
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.stats import RunSummary
from chatfleet.bench.sweep import Observer, RunRecord, SweepResult
from chatfleet.bench.workload_stats import WorkloadStats
from chatfleet.errors import ConfigError

DEFAULT_STATS = {"ttft": "p99", "itl": "p99", "reply": "p95"}


def shown_stats(slo: str | None) -> dict[str, str]:
    """Which percentile to show per metric: the one the SLO names, else ``DEFAULT_STATS``."""
    stats = dict(DEFAULT_STATS)
    if slo:
        with contextlib.suppress(ConfigError):
            for t in parse_slo(slo).targets:
                stats[t.metric] = t.stat
    return stats


def _stat(s: RunSummary, metric: str, stat: str) -> float:
    value = s.latency.get(metric, {}).get(stat)
    value = s.slo_values.get(f"{metric}_{stat}") if value is None else value
    return float("nan") if value is None else value


def _ms(v: float | None) -> str:
    if v is None or v != v:
        return "-"
    if v == float("inf"):
        return "inf"
    return f"{v * 1e3:.0f}ms" if v < 10 else f"{v:.1f}s"


class ProgressObserver(Observer):
    """One progress bar per run (time through warmup + measurement), and a line per finished run."""

    def __init__(self, console: Console | None = None, label: str = "") -> None:
        self.console = console or Console(stderr=True)
        self.label = label
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self.t_start = 0.0
        self.total = 0.0
        self.n = 0
        self.errors = 0

    def run_started(self, level: float, repeat: int, seed: int, load: LoadSpec) -> None:
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                                 TimeRemainingColumn(), console=self.console, transient=True)
        self.progress.start()
        self.total = load.warmup_s + load.duration_s
        self.t_start = time.monotonic()
        self.n = self.errors = 0
        desc = f"{self.label}{load.mode} {level:g} (repeat {repeat + 1}, seed {seed})"
        self.task = self.progress.add_task(desc, total=self.total, info="")

    def record_done(self, rec: RequestRecord) -> None:
        self.n += 1
        self.errors += rec.status != "ok"
        if self.progress is not None and self.task is not None:  # both set by run_started
            el = min(self.total, time.monotonic() - self.t_start)
            self.progress.update(self.task, completed=el, info=f"{self.n} req, {self.errors} err")

    def run_finished(self, run: RunRecord) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        s = run.summary
        stats = dict(DEFAULT_STATS, **dict(k.split("_", 1) for k in s.slo_values))  # the SLO's own
        verdict = "[green]meets SLO[/]" if s.slo_passed else "[red]breaks SLO[/]"
        aside = " [yellow](throttled: set aside)[/]" if run.throttled else ""
        hits = "-" if s.hit_rate is None else f"{s.hit_rate:.0%}"
        self.console.print(
            f"{self.label}load {run.level:g}: {s.requests} req, "
            f"ttft {stats['ttft']} {_ms(_stat(s, 'ttft', stats['ttft']))}, "
            f"itl {stats['itl']} {_ms(_stat(s, 'itl', stats['itl']))}, goodput {s.goodput:.2f}/s, hits {hits}, "
            f"{s.errors + s.rate_limited + s.timeouts} failed: {verdict}{aside}"
        )


def summary_table(s: RunSummary, title: str = "run") -> Table:
    t = Table(title=title)
    t.add_column("metric")
    for st in ("p50", "p90", "p95", "p99", "mean", "max"):
        t.add_column(st, justify="right")
    for m in ("ttft", "itl", "reply", "queue"):
        t.add_row(m, *(_ms(s.latency[m][st]) for st in ("p50", "p90", "p95", "p99", "mean", "max")))
    return t


def run_facts(s: RunSummary) -> Table:
    t = Table(show_header=False, title="outcome")
    hits = "-" if s.hit_rate is None else f"{s.hit_rate:.1%}"
    outcomes = f"{s.ok} / {s.errors} / {s.rate_limited} / {s.timeouts}"
    for k, v in (("requests", s.requests), ("ok / errors / 429 / timeouts", outcomes),
                 ("requests/s", f"{s.request_rate:.2f}"), ("output tokens/s", f"{s.output_tokens_per_s:.1f}"),
                 ("goodput (req/s in SLO)", f"{s.goodput:.2f}"), ("SLO attainment", f"{s.slo_attainment:.1%}"),
                 ("SLO", "met" if s.slo_passed else "broken"), ("prefix-cache hit rate", hits)):
        t.add_row(k, str(v))
    return t


VERDICT_TEXT = {"pass": "met", "fail": "[red]broken[/]", "undecided": "[yellow]undecided[/]"}


def _interval_cell(p, key: str) -> str:
    iv = p.judged.intervals.get(key) if p.judged is not None else None
    if iv is None:
        return "-"
    return f"{_ms(iv.estimate)} [{_ms(iv.low) if iv.low > 0 else '0'}, {_ms(iv.high)}] n={iv.n}"


def sweep_table(res: SweepResult, title: str) -> Table:
    """One row per load point; latency columns show the percentiles the SLO names. Judged points
    (a confidence level) add each target's interval over the point's requests pooled, with n."""
    t = Table(title=title)
    stats = shown_stats(res.slo)
    keys = [tg.key for tg in parse_slo(res.slo).targets] if any(p.judged for p in res.points) else []
    for c in ("load", "SLO", "goodput/s", *(f"{m} {stats[m]}" for m in ("ttft", "itl", "reply")), "hit rate", "runs",
              *(f"{k} interval" for k in keys)):
        t.add_column(c, justify="right")
    for p in res.points:
        kept = p.kept

        def mean(f, kept=kept):
            return sum(f(r.summary) for r in kept) / len(kept)

        hr = [r.summary.hit_rate for r in kept if r.summary.hit_rate is not None]
        extended = sum(r.extension for r in p.runs)
        t.add_row(f"{p.level:g}" + (" *" if p.level == res.knee else ""), VERDICT_TEXT[p.verdict],
                  f"{p.intervals['goodput'].mean:.2f}",
                  *(_ms(mean(lambda s, m=m: _stat(s, m, stats[m]))) for m in ("ttft", "itl", "reply")),
                  f"{sum(hr) / len(hr):.0%}" if hr else "-", str(len(p.runs)) + (f" (+{extended})" if extended else ""),
                  *(_interval_cell(p, k) for k in keys))
    return t


def reset_notes(res: SweepResult) -> list[str]:
    """Once each: why runs went without a verified cache reset (e.g. a gateway in front)."""
    return list(dict.fromkeys(r.reset.note for p in res.points for r in p.runs if r.reset.method == "not-reset"))


def undecided_lines(res: SweepResult, more: str = "raise --duration") -> list[str]:
    """Why each undecided point stayed so: its runs judged alone disagree (``run_agreement``), or
    the straddling interval and what would decide it (with the values that would, projected from
    the point's share within the target)."""
    slo = parse_slo(res.slo)
    targets = {tg.key: tg for tg in slo.targets}
    lines = []
    for p in res.points:
        if p.judged is None or p.verdict != "undecided":
            continue
        if why := disagreement(p.judged.verdict, p.judged.pooled, [r.verdict for r in p.judged.runs]):
            lines.append(f"load {p.level:g} undecided after {len(p.runs)} runs: {why}")
        level = next(iter(p.judged.intervals.values())).level
        to_decide = values_to_decide_point((rec for r in p.kept for rec in r.records), slo, p.judged, level)
        for k, v in p.judged.targets.items():
            if v != "undecided":
                continue
            n = to_decide.get(k)
            have = p.judged.intervals[k].n
            reach = ("; values like these would not decide it at any count" if n is None else
                     f"; values like these would decide it at about {n}" if n > have else "")
            lines.append(f"load {p.level:g} undecided after {len(p.runs)} runs: "
                         f"{why_undecided(targets[k], p.judged.intervals[k], more)}{reach}")
    return lines


def fleet_table(plans: dict[str, FleetPlan | None], title: str = "fleet") -> Table:
    t = Table(title=title)
    for c in ("series", "knee (chats/replica)", "peak chats", "headroom", "replicas", "GPUs", "$/conversation-hour"):
        t.add_column(c, justify="right")
    for name, f in plans.items():
        if f is None:
            t.add_row(name, "none", "-", "-", "-", "-", "-")
            continue
        cost = "-" if f.cost_per_conversation_hour is None else f"{f.cost_per_conversation_hour:.4f}"
        t.add_row(name, f"{f.knee:g}", str(f.peak_chats), f"{f.headroom:.0%}", str(f.replicas), str(f.gpus), cost)
    return t


def workload_table(s: WorkloadStats) -> Table:
    t = Table(title=f"workload {s.profile} (tokenizer: {s.tokenizer})", show_header=False)
    for k, v in s.to_dict().items():
        if k in ("profile", "tokenizer"):
            continue
        if isinstance(v, float):
            v = f"{v:.3g}" if v < 10 else f"{v:,.0f}"
        elif isinstance(v, dict):
            v = ", ".join(f"{a} {b:.0%}" for a, b in v.items())
        t.add_row(k.replace("_", " "), str(v))
    return t


def breakdown_tables(bd: Breakdown, title: str) -> list[Table]:
    """Hit rate and TTFT by turn index and by pause length (``bench/breakdown.py``)."""
    tables = []
    for what, groups in (("turn", bd.by_turn), ("pause", bd.by_pause)):
        t = Table(title=f"{title}: by {what}")
        for c in (what, *GROUP_COLUMNS):
            t.add_column(c, justify="right")
        for g in groups:
            t.add_row(*group_row(g))
        tables.append(t)
    return tables
