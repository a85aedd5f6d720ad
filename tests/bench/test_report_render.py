"""The HTML report as people read it: plots on linear axes with the SLO drawn, one colour and a
short label per series, whole-number loads, the knee marked, a caption under each plot; and the
page rendered in headless Chromium (skipped, with the reason, where it is not installed)."""

import json
import re
import shutil
import subprocess

import numpy as np
import pytest

from chatfleet.bench.point_verdict import judge_point
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.report import render_html, result_document, sweep_to_dict
from chatfleet.bench.report_plots import COLOURS, SLO_COLOUR, figures, short_labels
from chatfleet.bench.server_ops import ResetCheck
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.stats import confidence_interval, summarize
from chatfleet.bench.sweep import PointResult, RunRecord, SweepResult
from chatfleet.bench.telemetry import ClockSample, Telemetry

SLO = parse_slo("ttft_p95<=500ms,itl_p50<=40ms")


def synthetic_sweep(slowdown: float, seed: int) -> SweepResult:
    """Loads 2..10 live chats whose TTFT and ITL grow with load (by ``slowdown``); judged at 95%."""
    rng = np.random.default_rng(seed)
    points = []
    for level in (2, 4, 6, 8, 10):
        recs = []
        for i in range(400):
            ttft = float(rng.exponential(0.05 * level * slowdown))
            recs.append(RequestRecord(conv_id=i, turn=i % 5, character_id=0, slot=0, intended_s=0.0, ttft_s=ttft,
                                      reply_s=ttft + 1.0, queue_s=0.0, output_tokens=5, expected_tokens=5,
                                      itl_s=list(rng.normal(0.006 * level * slowdown, 0.001, 4)),
                                      prompt_tokens=100, cached_tokens=50 + 10 * (i % 5),
                                      pause_s=None if i % 5 == 0 else 2.0))
        tel = Telemetry("cpuinfo", 2600.0, [ClockSample(t, 2600.0 - 5 * t) for t in range(5)])
        run = RunRecord(level, 0, seed, ResetCheck("chatfleet", "usage", 10, 0, ""), tel, False,
                        summarize(recs, SLO, 20.0), 0.0, level, recs)
        judged = judge_point(recs, SLO)
        ivs = {"goodput": confidence_interval([run.summary.goodput]),
               **{t.key: confidence_interval([run.summary.slo_values[t.key]]) for t in SLO.targets}}
        points.append(PointResult(float(level), [run], judged.verdict == "pass", ivs, judged))
    passing = [p.level for p in points if p.passed]
    return SweepResult("closed", str(SLO), points, max(passing) if passing else None, True)


def document() -> dict:
    series = {"http://127.0.0.1:8000/v1": sweep_to_dict(synthetic_sweep(1.0, 1)),
              "http://10.0.0.7:8001": sweep_to_dict(synthetic_sweep(0.6, 2))}
    return json.loads(json.dumps(result_document("sweep", {"slo": str(SLO)}, series)))


def test_short_labels_are_host_and_port_and_distinct():
    labels = short_labels(["http://127.0.0.1:8000/v1", "https://user@gpu-7.example:443/", "stock", "stock ",
                           "a" * 40])
    assert labels["http://127.0.0.1:8000/v1"] == "127.0.0.1:8000"
    assert labels["https://user@gpu-7.example:443/"] == "gpu-7.example:443"
    assert len(set(labels.values())) == 5 and all(len(v) <= 28 for v in labels.values())


def test_plots_read_at_a_glance():
    doc = document()
    figs = figures(doc["series"])
    assert list(figs) == ["latency", "goodput", "hits", "clocks"]
    for key, (_, caption) in figs.items():  # one sentence each
        assert caption.endswith(".") and caption.count(". ") == 0 and len(caption) > 40, key
    fig, _ = figs["latency"]
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in axes] == ["TTFT p95", "ITL p50"]
    knees = [sw["knee"] for sw in doc["series"].values()]
    assert all(knees) and knees[0] < knees[1]  # the slower series breaks earlier
    for ax, threshold_ms in zip(axes, (500, 40), strict=True):
        assert ax.get_yscale() == "linear" and ax.get_ylabel() == "ms"
        slo_lines = [ln for ln in ax.get_lines() if ln.get_color() == SLO_COLOUR]
        assert slo_lines and set(slo_lines[0].get_ydata()) == {threshold_ms}
        named = ("127.0.0.1:8000", "10.0.0.7:8001")
        series_colours = {ln.get_color() for ln in ax.get_lines() if ln.get_label() in named}
        assert series_colours == set(COLOURS[:2])
        knee_lines = sorted(ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_linestyle() == ":")
        assert knee_lines == sorted(knees)
        fig.canvas.draw()
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)  # whole chats
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["127.0.0.1:8000", "10.0.0.7:8001", "SLO"]
    hits, _ = figs["hits"]
    labels = [t.get_text() for t in hits.legends[0].get_texts()]
    assert labels and all("http" not in t for t in labels)


def test_tables_show_verdicts_and_pooled_intervals():
    page = render_html(document())
    assert page.count("<figure>") == 4 and page.count("<figcaption>") == 4
    assert "(pooled, n)" in page and "n=400" in page and "met" in page and "broken" in page


def test_report_renders_in_headless_chromium(tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        print("chromium not installed: apt-get install -y chromium")
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    page = tmp_path / "report.html"
    page.write_text(render_html(document()), encoding="utf-8")
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1200,2400", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    import matplotlib.image

    img = matplotlib.image.imread(shot)
    assert img.shape[:2] == (2400, 1200)
    ink = (img[..., :3].mean(axis=2) < 0.9)  # anything not (near) white
    rows = ink.any(axis=1)
    assert rows.mean() > 0.5, "most of the page is blank: the plots did not render"
    # The plots' colours reach the screen (the two series' lines).
    for colour in COLOURS[:2]:
        rgb = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
        assert (np.abs(img[..., :3] - rgb).max(axis=2) < 0.05).sum() > 200, colour
    assert re.search(r"knee \d", page.read_text())
