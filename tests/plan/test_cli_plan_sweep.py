"""`chatfleet plan sweep` writes the result a measured sweep writes; `chatfleet fleet` reads it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from chatfleet.cli.main import app


def test_plan_sweep_result_feeds_chatfleet_fleet(tmp_path):
    out = tmp_path / "sim.json"
    res = CliRunner().invoke(app, ["plan", "sweep", "--model", "tiny", "--gpu", "cpu", "--weights", "fp32",
                                   "--kv-cache-tokens", "512", "--profile", "cpu-roleplay", "--duration", "8",
                                   "--warmup", "1", "--start", "2", "--max", "64", "--slo", "ttft_p99<=300ms",
                                   "--token-scale", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "cpu step costs: extrapolated" in res.output  # no gpu_check calibration for it
    doc = json.loads(out.read_text())
    assert doc["format"] == "chatfleet.bench" and doc["kind"] == "sweep" and doc["settings"]["simulated"]
    (series,) = doc["series"].values()
    assert series["knee"] is not None and series["points"][0]["runs"][0]["records"]
    assert doc["settings"]["serving"]["kv_tokens"] == 512 and series["knee_reached"]
    fleet = CliRunner().invoke(app, ["fleet", str(out), "--peak", "100"])
    assert fleet.exit_code == 0, fleet.output
    gpus = CliRunner().invoke(app, ["plan", "gpus"])
    assert gpus.exit_code == 0 and "H200" in gpus.output and "dense" in gpus.output
    bad = CliRunner().invoke(app, ["plan", "sweep", "--model", "tiny", "--gpu", "cpu", "--kv-cache-tokens", "2048",
                                   "--token-scale", "3"])
    assert bad.exit_code == 2 and "power of two" in bad.output
