"""The gate's files: per-item JSONL for both systems, summary.json, and report.html."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import jinja2

from chatfleet.gate.runner import GateConfig, GateOutcome


def _jsonl(path: Path, items: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")


def render_html(summary: dict, worst: dict[str, list[dict]]) -> str:
    text = resources.files("chatfleet.gate").joinpath("templates", "report.html.j2").read_text("utf-8")
    env = jinja2.Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True)
    env.filters["pct"] = lambda x: "-" if x is None else f"{100 * x:+.2f}" if isinstance(x, float) else x
    return env.from_string(text).render(s=summary, worst=worst)


def write_outputs(config: GateConfig, outcome: GateOutcome, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, result in outcome.suites.items():
        for role, items in (("baseline", result.baseline_items), ("candidate", result.candidate_items)):
            p = out_dir / f"{name}.{role}.jsonl"
            _jsonl(p, items)
            paths[f"{name}.{role}"] = p
    summary = outcome.summary(config)
    paths["summary"] = out_dir / "summary.json"
    paths["summary"].write_text(json.dumps(summary, indent=2, ensure_ascii=False), encoding="utf-8")
    paths["report"] = out_dir / "report.html"
    paths["report"].write_text(render_html(summary, {n: r.worst for n, r in outcome.suites.items()}),
                               encoding="utf-8")
    return paths
