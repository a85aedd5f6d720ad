"""`chatfleet gate`: a candidate server against a baseline on GSM8K, tool calls and role-play
likelihood. Exit 0 pass, 1 fail, 2 invalid run, 3 inconclusive (too few items to decide)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from chatfleet.errors import ChatfleetError
from chatfleet.gate.client import SamplingSettings
from chatfleet.gate.suite import Progress as SuiteProgress
from chatfleet.gate.suite import SuiteSettings

_S, _P = SuiteSettings(), SamplingSettings()

COLOURS = {"pass": "green", "fail": "red", "invalid": "yellow", "inconclusive": "yellow"}


def gate(
    baseline: str = typer.Option(..., "--baseline", help="URL of the stock server, e.g. http://127.0.0.1:8000"),
    candidate: str = typer.Option(..., "--candidate", help="URL of the server under test."),
    # The default is shown in words: as one comma-joined word it cannot wrap and was cut at 80 columns.
    suite: str = typer.Option("gsm8k,tools,tools_required,roleplay", "--suite", show_default=False,
                              help="Comma-separated: gsm8k, tools, tools_required, roleplay (default: all four)."),
    out: Path | None = typer.Option(None, "--out", help="Folder for the JSONL, summary.json and report.html."),
    baseline_api_key: str | None = typer.Option(None, "--baseline-api-key", envvar="GATE_BASELINE_API_KEY"),
    candidate_api_key: str | None = typer.Option(None, "--candidate-api-key", envvar="GATE_CANDIDATE_API_KEY"),
    baseline_model: str | None = typer.Option(None, "--baseline-model", help="Default: the first of /v1/models."),
    candidate_model: str | None = typer.Option(None, "--candidate-model", help="Default: the first of /v1/models."),
    gsm8k: Path | None = typer.Option(None, "--gsm8k", help="GSM8K test JSONL (question, answer '#### N')."),
    gsm8k_fewshot: Path | None = typer.Option(None, "--gsm8k-fewshot", help="JSONL of few-shot examples."),
    gsm8k_limit: int | None = typer.Option(None, "--gsm8k-limit", help="Only the first N questions."),
    gsm8k_shots: int = typer.Option(_S.gsm8k_shots, "--gsm8k-shots"),
    gsm8k_max_tokens: int = typer.Option(_S.gsm8k_max_tokens, "--gsm8k-max-tokens"),
    roleplay_conversations: int = typer.Option(_S.roleplay_conversations, "--roleplay-conversations"),
    roleplay_max_tokens: int = typer.Option(_S.roleplay_max_tokens, "--roleplay-max-tokens"),
    tools_max_tokens: int = typer.Option(_S.tools_max_tokens, "--tools-max-tokens"),
    tools_limit: int | None = typer.Option(None, "--tools-limit", help="Only the first N cases (plumbing checks)."),
    aa_items: int = typer.Option(_S.aa_items, "--aa-items", help="Items the baseline answers twice (A/A check)."),
    seed: int = typer.Option(_P.seed, "--seed", help="Sent as the sampling seed; also seeds the workload."),
    concurrency: int = typer.Option(4, "--concurrency", help="Requests in flight per server."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds per request."),
) -> None:
    """Run the quality gate of CANDIDATE against BASELINE (any OpenAI-compatible servers)."""
    from chatfleet.gate.report import write_outputs
    from chatfleet.gate.runner import GateConfig, ServerSpec, run_gate

    con = Console(stderr=True)
    try:
        config = GateConfig(
            ServerSpec(baseline, baseline_api_key, baseline_model),
            ServerSpec(candidate, candidate_api_key, candidate_model),
            suites=tuple(s.strip() for s in suite.split(",") if s.strip()), out_dir=out, concurrency=concurrency,
            timeout_s=timeout, sampling=SamplingSettings(seed=seed),
            settings=SuiteSettings(seed=seed, aa_items=aa_items, gsm8k_path=gsm8k, gsm8k_fewshot_path=gsm8k_fewshot,
                                   gsm8k_limit=gsm8k_limit, gsm8k_shots=gsm8k_shots, gsm8k_max_tokens=gsm8k_max_tokens,
                                   tools_max_tokens=tools_max_tokens, tools_limit=tools_limit,
                                   roleplay_conversations=roleplay_conversations,
                                   roleplay_max_tokens=roleplay_max_tokens))
        if "gsm8k" in config.suites and gsm8k is None:
            raise ChatfleetError("the gsm8k suite needs --gsm8k PATH (or leave it out of --suite)")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=con, transient=False) as bar:
            tasks: dict[str, TaskID] = {}

            def total(name: str, n: int) -> None:
                if name not in tasks:
                    tasks[name] = bar.add_task(name, total=n)
                else:
                    bar.update(tasks[name], total=n)

            outcome = asyncio.run(run_gate(config, SuiteProgress(total, lambda name, n: bar.advance(tasks[name], n))))
    except ChatfleetError as err:
        con.print(f"[red]error:[/] {err}")
        raise typer.Exit(2) from None
    for name, result in outcome.suites.items():
        colour = COLOURS[result.verdict.value]
        con.print(f"[bold]{name}[/] [{colour}]{result.verdict.value}[/] ({result.wall_s:.1f} s): {result.reason}")
        for note in result.notes:
            con.print(f"  note: {note}")
    colour = COLOURS[outcome.verdict.value]
    con.print(f"gate: [bold {colour}]{outcome.verdict.value.upper()}[/] ({outcome.wall_s:.1f} s) {outcome.reason}")
    if out is not None:
        paths = write_outputs(config, outcome, out)
        con.print(f"report: {paths['report']}\nsummary: {paths['summary']}")
    raise typer.Exit(outcome.exit_code)


def register(app: typer.Typer) -> None:
    app.command("gate")(gate)
