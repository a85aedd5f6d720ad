"""Wiring shared by `chatfleet bench`, `sweep` and `demo`: workload source, served model name."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from chatfleet.bench.tokens import TokenCounter, load_counter
from chatfleet.bench.traces import import_jsonl, import_sharegpt
from chatfleet.bench.transport import Endpoint
from chatfleet.bench.workload import Workload, WorkloadProfile
from chatfleet.errors import ConfigError


@dataclass(frozen=True)
class WorkloadSource:
    profile: WorkloadProfile
    tokenizer: str | None = None  # model folder, tokenizer.json, 'tiny', 'small' or None (estimate)
    trace: str | None = None  # OpenAI-messages JSONL
    sharegpt: str | None = None  # ShareGPT JSON
    history: str = "live"

    def __post_init__(self) -> None:
        if self.trace and self.sharegpt:
            raise ConfigError("give either --trace or --sharegpt, not both")

    def factory(self) -> tuple[Callable[[int], Workload], TokenCounter]:
        """A seed -> workload function (cards built per seed; traces read once)."""
        counter = load_counter(self.tokenizer)
        scripted = self.history == "trace"
        if self.trace:
            loaded = import_jsonl(self.trace, self.profile, counter)
        elif self.sharegpt:
            loaded = import_sharegpt(self.sharegpt, self.profile, counter)
        else:
            return (lambda seed: Workload(self.profile, seed, counter, scripted_replies=scripted)), counter

        def from_trace(seed: int):
            loaded.seed = seed  # think times of replacement chats follow the run's seed
            return loaded

        return from_trace, counter


def run_async(coro):
    """Run a coroutine on uvloop when it is installed (lower timing error), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def discover_model(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The first model the server lists on /v1/models."""
    ep = Endpoint.parse(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(ep.url("/v1/models"), timeout=timeout_s, headers=headers)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"could not read the model name from {ep.url('/v1/models')} ({e}); pass --model") from None
