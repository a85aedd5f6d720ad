"""The planner's step costs from a card's own gpu_check run: with no calibration every card is
extrapolated; a synthetic run made by a known memory efficiency and step overhead is fitted back
to them, applied to its card only, and `plan gpus` says which cards are calibrated."""

import json

import pytest

from chatfleet.errors import ConfigError
from chatfleet.plan.catalog import load_catalog
from chatfleet.plan.gpu_calibration import fit, read_measured


def _run(card="H200", date="2026-11-30T10:00:00Z", memory=0.62, overhead_ms=0.35, measured_gbps=4300.0,
         spec_gbps=4800.0):
    """A gpu_check.json whose engine rows follow step = overhead + spec_ms / memory exactly."""
    rows = []
    for batch, floor in ((1, 3.9), (8, 4.6), (32, 7.5)):
        for graphs in (False, True):
            spec_ms = floor * measured_gbps / spec_gbps
            step = overhead_ms + spec_ms / memory + (0.0 if graphs else 2.0)  # eager pays launches
            rows.append({"weights": "bf16", "kv": "bf16", "batch": batch, "context": 2048, "path": "engine",
                         "graphs": graphs, "step_ms": step, "floor_ms": floor})
        rows.append({"weights": "fp8", "kv": "fp8", "batch": batch, "path": "engine", "graphs": True,
                     "step_ms": 1.0, "floor_ms": floor / 2})
    return {"card": card, "date": date, "device": "NVIDIA H200", "bandwidth_gbps": measured_gbps, "decode": rows}


def test_without_calibrations_every_card_is_extrapolated():
    cat = load_catalog()
    assert cat.gpus and all(not g.calibration and g.step_costs.startswith("extrapolated") for g in cat.gpus)


def test_a_run_is_fitted_back_to_the_efficiency_that_made_it():
    f = fit(read_measured(_run(), "h200.json"), 4800.0)
    assert f.memory == pytest.approx(0.62) and f.step_overhead_ms == pytest.approx(0.35)
    assert len(f.measured.points) == 3  # the engine's rows with graphs, bf16 only
    assert "calibrated 2026-11-30" in f.describe()


def test_a_calibration_file_calibrates_its_card_only(tmp_path):
    (tmp_path / "H200-2026-10-01.json").write_text(json.dumps(_run(date="2026-10-01", memory=0.4)))
    (tmp_path / "H200-2026-11-30.json").write_text(json.dumps(_run()))
    before, after = load_catalog(calibrations=[]), load_catalog(calibrations=sorted(tmp_path.glob("*.json")))
    h200 = after.get("H200")
    assert h200.calibration.startswith("calibrated 2026-11-30")  # the newest run wins
    assert h200.efficiency.memory == pytest.approx(0.62) and h200.efficiency.step_overhead_ms == pytest.approx(0.35)
    assert h200.efficiency.compute == before.get("H200").efficiency.compute
    assert all(g == before.get(g.name) for g in after.gpus if g.name != "H200")


def test_bad_calibrations_fail_naming_the_file(tmp_path):
    f = tmp_path / "x.json"
    for doc, match in (({**_run(), "card": "Z99"}, "x.json.*unknown GPU"), ({"date": "d"}, "no 'card'"),
                       ({**_run(), "decode": []}, "no decode row")):
        f.write_text(json.dumps(doc))
        with pytest.raises(ConfigError, match=match):
            load_catalog(calibrations=[f])


def test_plan_gpus_says_which_cards_are_calibrated(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import chatfleet.plan.catalog as catalog
    from chatfleet.cli.main import app

    result = CliRunner().invoke(app, ["plan", "gpus"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "calibrated on the card (benchmarks/gpu_check.sh): 0 of" in result.output
    assert "extrapolated" in result.output and "H200" in result.output
    (tmp_path / "H200.json").write_text(json.dumps(_run()))
    monkeypatch.setattr(catalog, "packaged_calibrations", lambda: [tmp_path / "H200.json"])
    result = CliRunner().invoke(app, ["plan", "gpus"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "H200: calibrated 2026-11-30" in result.output and ": 1 of" in result.output
