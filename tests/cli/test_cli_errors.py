"""Every command fails the same way on the mistakes new users make: one clear line, exit code
2, never a traceback (bad sizes, dead URLs, missing files, taken ports, bad flags)."""

from __future__ import annotations

import json
import re
import socket

import pytest
import typer
from typer.testing import CliRunner

from chatfleet.bench.report import result_document
from chatfleet.cli.main import app
from chatfleet.engine.memory_check import host_memory


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def more_than_this_machine_has() -> str:
    memory = host_memory()
    return f"{(memory.total_bytes >> 30) + 16}GiB" if memory else "1TB"


def one_line_error(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


CASES = [
    (["engine", "--kv-cache-memory", "1TB"], "does not fit"),
    (["engine", "--kv-cache-memory", "MORE"], "does not fit"),
    (["engine", "--kv-cache-memory", "lots"], "cannot parse memory size"),
    (["engine", "--host-cache-memory", "MORE"], "does not fit"),
    (["engine", "--model", "/no/such/model"], "not a local folder"),
    (["engine", "--port", "TAKEN"], "cannot listen on 127.0.0.1:"),
    (["engine", "--max-running", "0"], "max_running"),
    (["serve", "--caps-from", "/no/such/sweep.json"], "cannot read sweep result"),
    (["serve", "--profile", "/no/such/profile.yaml"], "cannot read profile"),
    (["serve", "--replicas", "-1"], "replicas must be >= 0"),
    (["serve", "--model", "/no/such/model", "--port", "TAKEN"], "cannot listen"),
    (["serve", "--read-timeout", "0", "--replica", "http://127.0.0.1:1"], "read_timeout_s"),
    (["gateway", "--replica", "ftp://x"], "must look like http"),
    (["gateway", "--replica", "http://127.0.0.1:1", "--port", "TAKEN"], "cannot listen"),
    (["gateway", "--replica", "http://127.0.0.1:1", "--total-timeout", "-1"], "total_timeout_s"),
    (["bench", "--url", "DEAD", "--model", "X"], "cannot reach"),
    (["bench", "--url", "DEAD", "--slo", "fast"], "cannot parse SLO"),
    (["sweep", "--url", "DEAD"], "cannot reach"),
    (["bench", "--url", "DEAD", "--trace", "/no/such/trace.jsonl"], "trace"),
    (["fleet", "/no/such/result.json"], "cannot read result"),
    (["model", "tiny", "--out", "OUT", "--size", "huge"], "unknown tiny model size"),
    (["model", "tiny", "--out", "/proc/no/such/dir"], "No such file or directory"),
    (["demo", "--model", "/no/such/model"], "not a local folder"),
    (["demo", "--slo", "fast"], "cannot parse SLO"),
]


@pytest.mark.parametrize("args, words", CASES, ids=[" ".join(a[:3]) for a, _ in CASES])
def test_each_mistake_gives_one_line_and_exit_2(args, words, taken_port, tmp_path):
    subst = {"TAKEN": str(taken_port), "DEAD": dead_url(), "MORE": more_than_this_machine_has(),
             "OUT": str(tmp_path / "m")}
    line = one_line_error([subst.get(a, a) for a in args])
    assert words in line


@pytest.mark.parametrize("command", ["engine", "serve", "gateway", "bench", "sweep", "fleet", "demo", "model"])
def test_bad_flags_are_usage_errors(command):
    line = one_line_error([command, "--no-such-flag"])
    assert f"{command}: no such option --no-such-flag" in line and "did you mean" not in line
    assert f"{command} --help" in line


USAGE_CASES = [
    (["gateway", "--replica", "http://127.0.0.1:1", "--prot", "9"], ["no such option --prot; did you mean --port?"]),
    (["bench", "--url", "http://127.0.0.1:1", "--level", "abc"], ["'--level'", "valid number"]),
    (["bench", "--url", "http://127.0.0.1:1", "--repeats", "1.5"], ["'--repeats'", "valid integer"]),
    (["sweep"], ["Missing option '--url'"]),
    (["bech"], ["No such command 'bech'", "'bench'"]),
    (["fleet"], ["Missing argument"]),
]


@pytest.mark.parametrize("args, words", USAGE_CASES, ids=[" ".join(a[:2]) for a, _ in USAGE_CASES])
def test_click_usage_errors_are_one_line_naming_the_flag(args, words):
    line = one_line_error(args)
    assert all(w in line for w in words), line


def sweep_series(knee, knee_reached) -> dict:
    return {"mode": "closed", "slo": "ttft_p95<=1s", "knee": knee, "knee_reached": knee_reached,
            "knee_spread": {}, "points": []}


def test_fleet_refuses_a_result_without_a_knee_unless_told_the_level(tmp_path):
    one_point = tmp_path / "bench.json"  # `chatfleet bench` at 8 chats, which met the SLO
    one_point.write_text(json.dumps(result_document("bench", {}, {"http://x": sweep_series(8, False)})))
    line = one_line_error(["fleet", str(one_point), "--peak", "100"])
    assert "no measured knee" in line and "--level" in line
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(result_document("sweep", {}, {"http://x": sweep_series(None, True)})))
    assert "no level met the SLO" in one_line_error(["fleet", str(broken)])

    told = CliRunner().invoke(app, ["fleet", str(one_point), "--peak", "100", "--level", "8"])
    assert told.exit_code == 0 and "13" in told.output  # ceil(100 / 8) replicas
    swept = tmp_path / "sweep.json"
    swept.write_text(json.dumps(result_document("sweep", {}, {"http://x": sweep_series(10, True)})))
    sized = CliRunner().invoke(app, ["fleet", str(swept), "--peak", "100"])
    assert sized.exit_code == 0 and "10" in sized.output


@pytest.mark.parametrize("command", [["engine"], ["bench"], ["sweep"], ["fleet"], ["workload"], ["gateway"],
                                     ["serve"], ["demo"], ["gate"], ["model", "tiny"], []])
def test_help_reads_at_80_columns(command):
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert not [line for line in lines if "…" in line], "help cuts a flag name or a word at 80 columns"
    shown = typer.main.get_command(app)
    for name in command:
        shown = shown.commands[name]
    flags = [o for p in shown.params if not getattr(p, "hidden", False) for o in (*p.opts, *p.secondary_opts)]
    missing = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", result.output)]
    assert not missing, f"help leaves out {missing}"


def test_plan_memory_takes_the_one_size_syntax():
    def host_line(*flag):
        r = CliRunner().invoke(app, ["plan", "memory", "--model", "tiny", "--gpu", "L4", "--json", *flag])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)

    sized = host_line("--host-cache-memory", "12GiB")
    assert sized == host_line("--host-cache", "12") == host_line("--host-cache-memory", "12884901888")
    assert sized != host_line()
    assert "cannot parse memory size" in one_line_error(["plan", "memory", "--model", "tiny", "--gpu", "L4",
                                                         "--host-cache-memory", "lots"])
