"""`chatfleet gate` end to end on two built-in engines with the tiny model: an A/A gate passes,
a candidate that is really worse (the same folder with noise in one layer's weights) fails the
likelihood suite, a 20-question GSM8K slice runs through (at n = 20 no interval can certify a
1-point drop nor show one, so the honest verdict is inconclusive, exit 3), and an unreachable
server makes the run invalid."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from gate_data import GSM8K_FEWSHOT, GSM8K_TEST
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from chatfleet.cli.main import app
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.testing.engines import launch_engine

NOISY_TENSOR = "model.layers.1.mlp.down_proj.weight"
SMALL_RUN = ["--roleplay-conversations", "6", "--roleplay-max-tokens", "12", "--aa-items", "4"]


def noisy_copy(dst):
    shutil.copytree(resolve_model("tiny"), dst)
    weights = load_file(dst / "model.safetensors")
    w = weights[NOISY_TENSOR]
    weights[NOISY_TENSOR] = w + torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) * 2 * w.std()
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    worse = noisy_copy(tmp_path_factory.mktemp("noisy") / "tiny-noisy")
    fleets = {"stock": launch_engine("tiny"), "worse": launch_engine(str(worse))}
    try:
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda f: f.start(), fleets.values()))
        yield {name: f.url for name, f in fleets.items()}
    finally:
        for f in fleets.values():
            f.stop()


def gate(baseline, candidate, out, *args):
    result = CliRunner().invoke(app, ["gate", "--baseline", baseline, "--candidate", candidate, "--out", str(out),
                                      *args])
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
    return result, summary


def test_aa_gate_passes_and_writes_its_files(engines, tmp_path):
    url = engines["stock"]
    r, s = gate(url, url, tmp_path, "--suite", "tools,roleplay", "--tools-limit", "4", "--tools-max-tokens", "8",
                *SMALL_RUN)
    assert r.exit_code == 0, r.output
    assert s["verdict"] == "pass" and s["suites_run"] == ["tools", "roleplay"]
    assert s["baseline"]["models"] == ["tiny"] and s["sampling"]["temperature"] == 0.0
    rp = s["suites"]["roleplay"]["metrics"]
    assert rp["scored"] == 6 and rp["mean_dnll"] == 0.0 and rp["aa"]["items"] == 4
    assert s["suites"]["tools"]["metrics"]["table"]["n"] == 4
    lines = (tmp_path / "roleplay.candidate.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all(len(json.loads(x)["nll"]) > 0 for x in lines)
    assert len((tmp_path / "tools.baseline.jsonl").read_text().splitlines()) == 4
    assert "PASS" in (tmp_path / "report.html").read_text()


def test_a_really_worse_candidate_fails_the_likelihood_suite(engines, tmp_path):
    r, s = gate(engines["stock"], engines["worse"], tmp_path, "--suite", "roleplay", *SMALL_RUN)
    assert r.exit_code == 1, r.output
    rp = s["suites"]["roleplay"]
    assert rp["verdict"] == "fail" and rp["metrics"]["interval"]["low"] > 0.02, rp
    assert "outside" in rp["reason"]
    assert "dnll" in (tmp_path / "report.html").read_text()


def test_gsm8k_slice_runs_through(engines, tmp_path):
    url = engines["stock"]
    r, s = gate(url, url, tmp_path, "--suite", "gsm8k", "--gsm8k", str(GSM8K_TEST), "--gsm8k-fewshot",
                str(GSM8K_FEWSHOT), "--gsm8k-limit", "20", "--gsm8k-shots", "1", "--gsm8k-max-tokens", "8",
                "--aa-items", "4")
    m = s["suites"]["gsm8k"]["metrics"]
    assert m["table"]["n"] == 20 and m["table"]["baseline_only"] == m["table"]["candidate_only"] == 0
    assert m["aa"] == {"items": 4, "disagreement": 0.0} and m["shots"] == 1
    assert m["lower_bound"] < -0.01 and r.exit_code == 3, r.output  # 20 questions cannot decide
    assert s["verdict"] == "inconclusive" and s["suites"]["gsm8k"]["verdict"] == "inconclusive"
    assert set(m["intervals"]) >= {"tango", "newcombe"} and 0 <= m["mcnemar_p"] <= 1
    assert len((tmp_path / "gsm8k.baseline.jsonl").read_text().splitlines()) == 20


def test_an_unreachable_server_makes_the_run_invalid(engines, tmp_path):
    r, s = gate(engines["stock"], "http://127.0.0.1:9", tmp_path, "--suite", "roleplay")
    assert r.exit_code == 2 and s["verdict"] == "invalid" and "did not answer" in s["reason"]
