"""`chatfleet demo` end to end on the tiny model with short runs."""

import json

from typer.testing import CliRunner

from chatfleet.cli.main import app


def test_demo_sweeps_stock_and_tuned_and_writes_the_report(tmp_path):
    out = tmp_path / "demo"
    r = CliRunner().invoke(app, ["demo", "--model", "tiny", "--threads", "1", "--duration", "1.0", "--warmup", "0.3",
                                 "--max-points", "2", "--price", "2.0", "--out-dir", str(out)])
    assert r.exit_code == 0, r.output
    assert "stock" in r.output and "tuned" in r.output and "fleet for 2200 peak chats" in r.output
    doc = json.loads((out / "result.json").read_text())
    assert doc["kind"] == "demo" and set(doc["series"]) == {"stock", "tuned"}
    assert "--no-prefix-cache" in doc["settings"]["engine_args"]["stock"]
    assert "--max-running" in doc["settings"]["engine_args"]["tuned"]
    for name, sw in doc["series"].items():
        assert sw["points"], name
        fleet = doc["fleet"][name]
        if sw["knee"]:
            assert fleet["replicas"] == -(-2200 // int(sw["knee"]))
            assert fleet["cost_per_conversation_hour"] > 0
    # The tuned engine caches the shared cards and histories; stock caches nothing.
    def hits(name):
        return [r["summary"]["hit_rate"] for p in doc["series"][name]["points"] for r in p["runs"]]
    assert all(h == 0 for h in hits("stock")) and all(h > 0.3 for h in hits("tuned"))
    assert (out / "report.html").read_text().count("<img") == 4
