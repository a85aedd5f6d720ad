"""What every gate suite shares: its context (two clients, settings, progress), its result,
and the registry of suites by name."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from chatfleet.gate.client import GateClient, SamplingSettings
from chatfleet.registry import Registry


class Verdict(str, Enum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"  # valid, but its items cannot support a decision either way
    INVALID = "invalid"  # the run cannot decide: unreachable server, too many errors, A/A disagrees


@dataclass(frozen=True)
class SuiteSettings:
    """Everything a suite reads from the command line (frozen; defaults are the gate's)."""

    seed: int = 0
    confidence: float = 0.95
    max_error_rate: float = 0.05  # more failed requests than this: invalid
    aa_items: int = 10  # items the baseline answers twice (A/A check)
    aa_max_disagreement: float = 0.05
    # GSM8K
    gsm8k_path: Path | None = None
    gsm8k_fewshot_path: Path | None = None
    gsm8k_limit: int | None = None
    gsm8k_shots: int = 5
    gsm8k_max_tokens: int = 320
    gsm8k_margin: float = 0.01  # the lower bound of the difference must be >= -margin
    gsm8k_samples: int = 5  # answers per question when greedy is not deterministic
    gsm8k_sample_temperature: float = 0.7
    # tool calls
    tools_max_tokens: int = 256
    tools_limit: int | None = None  # only the first N cases (plumbing checks; the decision wants all 40)
    # role-play likelihood
    roleplay_conversations: int = 24
    roleplay_max_tokens: int = 48
    roleplay_margin: float = 0.02  # the dNLL interval must lie within +-margin (nats/token)
    roleplay_profile: str = "cpu-roleplay"


@dataclass
class SuiteResult:
    name: str
    verdict: Verdict
    reason: str  # one line: why it passed, failed or is invalid
    metrics: dict
    baseline_items: list[dict]
    candidate_items: list[dict]
    worst: list[dict] = field(default_factory=list)  # side-by-side rows for the report
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        return {"verdict": self.verdict.value, "reason": self.reason, "metrics": self.metrics,
                "notes": self.notes, "wall_s": round(self.wall_s, 3)}


class Progress:
    """Progress callbacks a suite reports through (the CLI draws a bar; tests pass nothing)."""

    def __init__(self, on_total: Callable[[str, int], None] | None = None,
                 on_advance: Callable[[str, int], None] | None = None) -> None:
        self._total = on_total or (lambda name, n: None)
        self._advance = on_advance or (lambda name, n: None)

    def total(self, suite: str, n: int) -> None:
        self._total(suite, n)

    def advance(self, suite: str, n: int = 1) -> None:
        self._advance(suite, n)


@dataclass
class SuiteContext:
    baseline: GateClient
    candidate: GateClient
    sampling: SamplingSettings
    settings: SuiteSettings
    progress: Progress = field(default_factory=Progress)
    started: float = field(default_factory=time.monotonic)


Suite = Callable[[SuiteContext], Awaitable[SuiteResult]]
# A registry holds factories of its type: each suite registered is a Suite, so SUITES.make(name,
# ctx) calls it and gives the awaitable of its result.
SUITES = Registry[Awaitable[SuiteResult]]("gate suite")


def error_rate_reason(errors: int, total: int, limit: float) -> str | None:
    """The invalid-run reason when too many requests failed, else None."""
    if total and errors / total > limit:
        return f"{errors} of {total} requests failed (more than {limit:.0%}): the run cannot decide"
    return None
