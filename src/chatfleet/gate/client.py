"""The gate's OpenAI client for one server: identity, tokenize, completions and chat.

Every request carries every sampling parameter explicitly (``SamplingSettings``), so two servers
with different defaults still run the same experiment. Transient failures (connection errors,
5xx, 429) are retried a few times; what still fails is returned as an error value, counted by
the suites, never raised mid-run.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field

import httpx

from chatfleet.errors import ChatfleetError

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
VERSION_HEADERS = ("server", "x-version", "x-server-version", "x-chatfleet-version", "openai-version")


class ServerUnreachableError(ChatfleetError):
    """A server under test did not answer ``/v1/models``."""

    error_type = "server_unreachable"


@dataclass(frozen=True)
class SamplingSettings:
    """Sent in full with every request: nothing is left to a server's defaults."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # vLLM extension; -1: off
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1

    def body(self, max_tokens: int) -> dict:
        return {**asdict(self), "max_tokens": max_tokens}


@dataclass(frozen=True)
class ServerIdentity:
    url: str
    model: str  # the model name sent in requests
    models: list[str]  # ids from /v1/models
    headers: dict[str, str]  # version-like response headers
    version: dict | None  # GET /version, where the server has it (vLLM)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Reply:
    """One completion or chat reply; ``error`` is set (and the rest empty) when it failed."""

    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # from logprobs with return_tokens_as_token_ids
    token_logprobs: list[float | None] = field(default_factory=list)
    tool_calls: list[dict] | None = None  # chat: the message's tool_calls as sent
    raw: dict | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _ids_from_tokens(tokens: list[str]) -> list[int] | None:
    """``token_id:N`` strings (vLLM's return_tokens_as_token_ids) -> ids; None if any is not."""
    out = []
    for t in tokens:
        if not t.startswith("token_id:"):
            return None
        try:
            out.append(int(t[len("token_id:"):]))
        except ValueError:
            return None
    return out


class GateClient:
    def __init__(self, url: str, *, api_key: str | None = None, model: str | None = None,
                 timeout_s: float = 300.0, retries: int = 2, concurrency: int = 4) -> None:
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers,
                                      trust_env=False)
        self.model = model
        self.retries = retries
        self.slots = asyncio.Semaphore(concurrency)

    async def close(self) -> None:
        await self.http.aclose()

    async def identify(self) -> ServerIdentity:
        try:
            r = await self.http.get(self.url + "/v1/models")
            r.raise_for_status()
            models = [m["id"] for m in r.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise ServerUnreachableError(f"{self.url}/v1/models did not answer: {type(exc).__name__}: {exc}") from exc
        if not models and self.model is None:
            raise ServerUnreachableError(f"{self.url}/v1/models lists no model; give the model name")
        headers = {k: v for k, v in r.headers.items() if k.lower() in VERSION_HEADERS}
        version = None
        try:
            v = await self.http.get(self.url + "/version")
            if v.status_code == 200:
                version = v.json()
        except (httpx.HTTPError, ValueError):
            pass
        self.model = self.model or models[0]
        return ServerIdentity(self.url, self.model, models, headers, version)

    async def _post(self, path: str, body: dict) -> dict | str:
        """The JSON reply, or an error message after the retries."""
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(0.5 * attempt)
            try:
                async with self.slots:
                    r = await self.http.post(self.url + path, json={"model": self.model, **body})
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if r.status_code == 200:
                try:
                    return r.json()
                except ValueError:
                    return f"{path}: the reply is not JSON"
            last = f"HTTP {r.status_code}: {r.text[:300]}"
            if r.status_code not in RETRY_STATUSES:
                break
        return last

    async def tokenize_chat(self, messages: list[dict]) -> list[int] | str:
        out = await self._post("/tokenize", {"messages": messages, "add_generation_prompt": True})
        if isinstance(out, str):
            return out
        tokens = out.get("tokens")
        return tokens if isinstance(tokens, list) else "/tokenize gave no tokens"

    async def complete_ids(self, prompt_ids: list[int], sampling: SamplingSettings, max_tokens: int, *,
                           echo: bool = False) -> Reply:
        """Legacy completion of a token-id prompt, with logprobs of each token as token ids."""
        body = {**sampling.body(max_tokens), "prompt": prompt_ids, "echo": echo, "logprobs": 0,
                "return_tokens_as_token_ids": True, "stream": False}
        out = await self._post("/v1/completions", body)
        if isinstance(out, str):
            return Reply(error=out)
        try:
            choice = out["choices"][0]
            lp = choice.get("logprobs") or {}
            ids = _ids_from_tokens(lp.get("tokens") or [])
            if ids is None:
                return Reply(error="the server did not return tokens as token ids (return_tokens_as_token_ids)",
                             raw=out)
            return Reply(choice.get("text") or "", choice.get("finish_reason"), ids,
                         list(lp.get("token_logprobs") or []), raw=out)
        except (KeyError, IndexError, TypeError) as exc:
            return Reply(error=f"malformed completion: {exc!r}", raw=out)

    async def chat(self, messages: list[dict], sampling: SamplingSettings, max_tokens: int, *,
                   tools: list[dict] | None = None, tool_choice: str = "auto") -> Reply:
        body: dict = {**sampling.body(max_tokens), "messages": messages, "stream": False}
        if tools is not None:
            body.update(tools=tools, tool_choice=tool_choice)
        out = await self._post("/v1/chat/completions", body)
        if isinstance(out, str):
            return Reply(error=out)
        try:
            choice = out["choices"][0]
            msg = choice["message"]
            return Reply(msg.get("content") or "", choice.get("finish_reason"),
                         tool_calls=msg.get("tool_calls"), raw=out)
        except (KeyError, IndexError, TypeError) as exc:
            return Reply(error=f"malformed chat completion: {exc!r}", raw=out)
