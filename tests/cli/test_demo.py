"""`chatfleet demo` end to end on the tiny model with short runs."""

import json

from typer.testing import CliRunner

from chatfleet.cli.main import app


def test_demo_sweeps_stock_and_tuned_at_one_budget_and_writes_the_report(tmp_path):
    out = tmp_path / "demo"
    r = CliRunner().invoke(app, ["demo", "--model", "tiny", "--profile", "cpu-roleplay", "--threads", "1",
                                 "--duration", "0.8", "--warmup", "0.2", "--start", "2", "--max-points", "2",
                                 "--repeats", "2", "--extend-up-to", "1",
                                 "--max-point", "2", "--series-budget", "8",
                                 "--kv-cache-tokens", "1024", "--price", "2.0", "--out-dir", str(out)])
    assert r.exit_code == 0, r.output
    assert "stock" in r.output and "tuned" in r.output and "fleet for 2200 peak chats" in r.output
    assert "device KV budget for every series: 1,024 tokens" in r.output
    assert "bracket" in r.output and "by turn" in r.output and "by pause" in r.output
    doc = json.loads((out / "result.json").read_text())
    assert doc["kind"] == "demo" and set(doc["series"]) == {"stock", "tuned"}
    # The machine it ran on, and the ratio with its range or, plainly, why there is none.
    assert "machine: " in r.output and doc["machine"]["cpu_model"] and doc["machine"]["logical_cpus"] >= 1
    # The code it measured: this checkout's commit (and the tracked files changed beside it).
    assert doc["code"]["commit"] and f"code at {doc['code']['commit']}" in r.output
    ratio = doc["ratio"]
    if doc["series"]["stock"]["knee"] and doc["series"]["tuned"]["knee"]:
        t = ratio["tuned_over_stock"]
        assert t["low"] <= t["value"] <= (t["high"] or float("inf")) and "tuned holds" in r.output
    else:
        assert ratio["tuned_over_stock"] is None and "no knee for" in ratio["why_none"]
        assert "no tuned/stock ratio" in r.output and "no knee (bracket" in r.output
        missing = [n for n, sw in doc["series"].items() if not sw["knee"]]
        assert all(doc["knees"][n]["why_none"] for n in missing)
    args = doc["settings"]["engine_args"]
    # Stock is the engine's defaults (prefix cache and chunked prefill on) at the shared budget.
    assert args["stock"] == ["--kv-cache-tokens", "1024"]
    assert args["tuned"][:2] == ["--kv-cache-tokens", "1024"] and "--max-running" in args["tuned"]
    assert set(doc["settings"]["tuned_techniques"]) | set(doc["settings"]["tuned_techniques_missing"]) == {
        "cap", "host_tier", "session_eviction"}
    for name, sw in doc["series"].items():
        assert sw["points"], name
        assert len(sw["knee_spread"]["knees"]) == 2
        if sw["knee"]:
            assert doc["settings"]["working_set_tokens_at_knee"][name] > 0
        assert all(len(p["runs"]) == 2 and p["breakdown"]["by_turn"] for p in sw["points"])
        fleet = doc["fleet"][name]
        if sw["knee"]:
            assert fleet["replicas"] == -(-2200 // int(sw["knee"]))
            assert fleet["cost_per_conversation_hour"] > 0

    # Both engines cache the shared cards and histories (stock too: it is the default).
    def hit_rate(name):
        runs = [r["summary"] for p in doc["series"][name]["points"] for r in p["runs"]]
        cached = sum(h["cached_tokens"] for s in runs for h in s["hits_by_turn"].values())
        return cached / sum(h["prompt_tokens"] for s in runs for h in s["hits_by_turn"].values())
    assert hit_rate("stock") > 0.2 and hit_rate("tuned") > 0.2
    page = (out / "report.html").read_text()
    assert "Machine: " in page and ("tuned / stock" in page or "No tuned / stock ratio" in page)
    assert page.count("<img") == 4 and "by turn index" in page and "by pause before the turn" in page
