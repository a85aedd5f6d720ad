"""`chatfleet bench`, `sweep`, `fleet` and `workload` end to end against the scripted server."""

import json

from typer.testing import CliRunner

from chatfleet.cli.main import app

runner = CliRunner()


def test_bench_sweep_fleet(scripted, tmp_path):
    url = scripted("--ttft-ms", "5", "--itl-ms", "2", "--itl-per-stream-ms", "4")
    r = runner.invoke(app, ["bench", "--url", url, "--level", "2", "--mode", "concurrency", "--duration", "0.5",
                            "--warmup", "0", "--out", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    assert "goodput" in r.output and json.loads((tmp_path / "b.json").read_text())["kind"] == "bench"

    out, html = tmp_path / "s.json", tmp_path / "s.html"
    r = runner.invoke(app, ["sweep", "--url", url, "--mode", "concurrency", "--slo", "itl_p50<=30ms", "--start", "4",
                            "--max", "32", "--duration", "0.6", "--warmup", "0.2", "--peak", "2200",
                            "--price", "2.5", "--out", str(out), "--html", str(html)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    knee = doc["series"][url]["knee"]
    assert knee and f"knee: {knee:g}" in r.output and html.read_text().startswith("<!doctype html>")
    assert doc["fleet"][url]["replicas"] == -(-2200 // knee)

    r = runner.invoke(app, ["fleet", str(out), "--peak", "2200", "--headroom", "0.1"])
    assert r.exit_code == 0, r.output
    assert str(-(-2420 // int(knee))) in r.output


def test_bad_input_is_a_clear_error(tmp_path):
    r = runner.invoke(app, ["bench", "--url", "http://127.0.0.1:9", "--model", "m", "--slo", "ttft<=1s"])
    assert r.exit_code == 2 and "cannot parse SLO target" in r.output
    r = runner.invoke(app, ["bench", "--url", "ftp://x", "--model", "m"])
    assert r.exit_code == 2 and "server URL" in r.output
    r = runner.invoke(app, ["fleet", str(tmp_path / "missing.json")])
    assert r.exit_code == 2 and "cannot read result" in r.output


def test_workload_stats_and_export(tmp_path):
    r = runner.invoke(app, ["workload", "--profile", "cpu-roleplay", "--conversations", "30",
                            "--export", str(tmp_path / "t.jsonl")])
    assert r.exit_code == 0, r.output
    assert "request tokens mean" in r.output
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert len(lines) == 30 and json.loads(lines[0])["messages"][0]["role"] == "system"


def test_an_undecided_point_says_so_on_the_console_and_in_the_json(scripted, tmp_path):
    url = scripted("--ttft-ms", "2", "--itl-ms", "1")
    r = runner.invoke(app, ["bench", "--url", url, "--level", "2", "--mode", "concurrency", "--duration", "0.3",
                            "--warmup", "0", "--slo", "ttft_p99<=1s", "--extend-up-to", "2",
                            "--out", str(tmp_path / "b.json")], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "SLO at load 2: undecided" in r.output and "after 2 runs" in r.output and ">= 368 values" in r.output
    point = json.loads((tmp_path / "b.json").read_text())["series"][url]["points"][0]
    assert point["verdict"] == "undecided" and [r["extension"] for r in point["runs"]] == [False, True]
    assert point["confidence"]["intervals"]["ttft_p99"]["high"] == float("inf")
    # --confidence 0 judges by the estimate alone, as before: one run, met.
    r = runner.invoke(app, ["bench", "--url", url, "--level", "2", "--mode", "concurrency", "--duration", "0.3",
                            "--warmup", "0", "--slo", "ttft_p99<=1s", "--confidence", "0"])
    assert r.exit_code == 0 and "SLO at load 2: met" in r.output, r.output
