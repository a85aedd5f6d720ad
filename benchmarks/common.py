"""Shared helpers for the benchmark scripts: server subprocesses, health waits, a streaming client.

Not part of the package or the tests. The client speaks plain OpenAI HTTP (SSE streaming) so the
same code measures ours, vLLM and `transformers serve`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from chatfleet.loopback import free_port  # noqa: F401  (the scripts here import it from common)
from chatfleet.protocol.sse import aiter_sse

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "benchmarks"
RESULTS_DIR = BENCH_DIR / "results"


TEMPLATE_OVERHEAD = 8  # ChatML tokens around one user message plus the generation prompt


class PromptFactory:
    """Distinct prompts of about n tokens (by the served model's own tokenizer)."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        try:
            from chatfleet.engine.builtin_models.corpus import corpus_files

            words = corpus_files().get("en", "").split()
        except ImportError:
            words = []
        rng = random.Random(seed)
        self.words = sorted(set(words)) or [
            "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
            for _ in range(5000)
        ]
        self.seed = seed
        self.counter = 0

    def make(self, n_tokens: int) -> str:
        self.counter += 1
        rng = random.Random(self.seed * 1_000_003 + self.counter)
        target = max(1, n_tokens - TEMPLATE_OVERHEAD)
        head = f"Conversation {self.counter}-{rng.randrange(10**9)}:"
        text = head + " " + " ".join(rng.choices(self.words, k=target))
        ids = self.tok.encode(text, add_special_tokens=False).ids[:target]
        return self.tok.decode(ids)


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


@dataclass
class ServerProcess:
    """A server started as its own process group; `stop()` ends the whole group. It stays in the
    benchmark's session: a session of its own is a scheduling group of its own (Linux autogroup),
    where its niced workers would take an equal share of a core from the clients measuring it."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, **self.env}
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0
        )

    def wait_healthy(self, path: str = "/health", timeout_s: float = 600.0) -> float:
        """Poll GET `path` until 200; returns seconds since start. Raises if the process exits."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base_url + path, timeout=2.0).status_code == 200:
                    self.ready_s = time.monotonic() - self.started_at
                    return self.ready_s
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy after {timeout_s:.0f}s; see {self.log_path}")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGINT)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        # Children (vLLM's engine core) may outlive the parent: end the rest of the group.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class StreamResult:
    """One streamed request as the client saw it."""

    ok: bool
    ttft_s: float | None  # send -> first chunk with generated text
    e2e_s: float
    output_tokens: int  # from usage when the server reports it, else content chunks
    prompt_tokens: int | None
    cached_tokens: int | None
    error: str | None = None


async def stream_chat(
    client: httpx.AsyncClient,
    base_url: str,
    body: dict[str, Any],
) -> StreamResult:
    """POST a streaming chat completion and time it. `body` is the OpenAI request (stream is set)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", base_url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return StreamResult(False, None, time.perf_counter() - t0, 0, None, None,
                                    f"HTTP {resp.status_code}: {text[:300]}")
            async for sse in aiter_sse(resp.aiter_bytes()):
                if sse.is_done:
                    break
                event = sse.json()
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return StreamResult(False, ttft, time.perf_counter() - t0, chunks, None, None, repr(exc))
    e2e = time.perf_counter() - t0
    out_tokens = chunks
    prompt_tokens = cached = None
    if usage:
        out_tokens = usage.get("completion_tokens") or chunks
        prompt_tokens = usage.get("prompt_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return StreamResult(True, ttft, e2e, out_tokens, prompt_tokens, cached)


def percentile(values: list[float], q: float) -> float | None:
    """q in [0, 100], linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


async def post_json(base_url: str, path: str, body: dict | None = None, timeout: float = 60.0) -> httpx.Response:
    async with httpx.AsyncClient(timeout=timeout) as client:
        return await client.post(base_url + path, json=body or {})


def run(coro):  # noqa: ANN001, ANN201 - thin alias so scripts read plainly
    return asyncio.run(coro)
