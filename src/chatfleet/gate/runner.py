"""Run the gate: identify both servers, run the chosen suites, write the results, decide.

Exit codes: 0 every suite passed, 1 some suite failed, 2 the run is invalid (a server did not
answer, too many requests failed, or an A/A check disagreed with itself), 3 inconclusive: no suite
failed, but some suite's items cannot support a decision either way (too few of them).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from chatfleet.errors import ConfigError
from chatfleet.gate.client import GateClient, SamplingSettings, ServerIdentity, ServerUnreachableError
from chatfleet.gate.suite import SUITES, Progress, SuiteContext, SuiteResult, SuiteSettings, Verdict

# Importing the suites registers them.
from chatfleet.gate import gsm8k, roleplay, tools  # noqa: F401,E402  isort: skip

EXIT_CODES = {Verdict.PASS: 0, Verdict.FAIL: 1, Verdict.INVALID: 2, Verdict.INCONCLUSIVE: 3}


@dataclass(frozen=True)
class ServerSpec:
    url: str
    api_key: str | None = None
    model: str | None = None  # None: the first model of /v1/models


@dataclass(frozen=True)
class GateConfig:
    baseline: ServerSpec
    candidate: ServerSpec
    suites: tuple[str, ...] = ("gsm8k", "tools", "tools_required", "roleplay")
    out_dir: Path | None = None
    concurrency: int = 4
    timeout_s: float = 300.0
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    settings: SuiteSettings = field(default_factory=SuiteSettings)

    def __post_init__(self) -> None:
        if not self.suites:
            raise ConfigError("choose at least one suite")
        for name in self.suites:
            SUITES.check(name)
        if len(set(self.suites)) != len(self.suites):
            raise ConfigError(f"a suite is named twice in {self.suites}")
        if self.concurrency < 1:
            raise ConfigError("concurrency must be >= 1")
        if self.sampling.temperature != 0:
            raise ConfigError("the gate compares greedy answers: temperature must be 0")


@dataclass
class GateOutcome:
    verdict: Verdict
    reason: str
    suites: dict[str, SuiteResult]
    identities: dict[str, ServerIdentity | None]
    wall_s: float

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def summary(self, config: GateConfig) -> dict:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config.settings).items()}
        return {
            "verdict": self.verdict.value, "exit_code": self.exit_code, "reason": self.reason,
            "wall_s": round(self.wall_s, 3),
            "baseline": self.identities["baseline"].to_dict() if self.identities["baseline"] else
            {"url": config.baseline.url},
            "candidate": self.identities["candidate"].to_dict() if self.identities["candidate"] else
            {"url": config.candidate.url},
            "sampling": asdict(config.sampling), "settings": settings, "suites_run": list(config.suites),
            "suites": {name: r.summary() for name, r in self.suites.items()},
        }


def overall(results: dict[str, SuiteResult]) -> tuple[Verdict, str]:
    for verdict in (Verdict.INVALID, Verdict.FAIL, Verdict.INCONCLUSIVE):
        bad = [f"{n}: {r.reason}" for n, r in results.items() if r.verdict is verdict]
        if bad:
            return verdict, "; ".join(bad)
    return Verdict.PASS, "every suite passed"


async def run_gate(config: GateConfig, progress: Progress | None = None) -> GateOutcome:
    t0 = time.monotonic()
    clients = {role: GateClient(spec.url, api_key=spec.api_key, model=spec.model, timeout_s=config.timeout_s,
                                concurrency=config.concurrency)
               for role, spec in (("baseline", config.baseline), ("candidate", config.candidate))}
    identities: dict[str, ServerIdentity | None] = {"baseline": None, "candidate": None}
    results: dict[str, SuiteResult] = {}
    try:
        try:
            for role, client in clients.items():
                identities[role] = await client.identify()
        except ServerUnreachableError as exc:
            return GateOutcome(Verdict.INVALID, str(exc), results, identities, time.monotonic() - t0)
        ctx = SuiteContext(clients["baseline"], clients["candidate"], config.sampling, config.settings,
                           progress or Progress())
        for name in config.suites:
            results[name] = await SUITES.make(name, ctx)
    finally:
        for client in clients.values():
            await client.close()
    verdict, reason = overall(results)
    return GateOutcome(verdict, reason, results, identities, time.monotonic() - t0)
