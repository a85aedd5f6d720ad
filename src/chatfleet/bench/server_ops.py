"""Control calls to the server under test: prefix-cache reset with verification, metrics.

The reset is verified with a probe: a unique prompt is sent twice (the second time it should
hit), the cache is reset, and the prompt is sent again: it must now report no cached tokens,
read from ``usage.prompt_tokens_details.cached_tokens`` or, when the server does not report
it, from the ``vllm:prefix_cache_hits`` counter. Anything else fails loudly.

Through a chatfleet gateway (``chatfleet serve``, ``chatfleet gateway``: it answers
``/gateway/status``) the reset goes to every replica at once and the gateway reports each
(``{"success", "replicas": [{"url", "success", "error"}, ...]}``); a replica that failed is named
in the error. The probe then verifies the flush end to end: its conversation lands on the same
replica each time (the gateway's session affinity), so a cached token after the reset means that
replica kept its cache. An older gateway that answers the reset 404 does not pass it on: the run
goes ahead without one and says so (``ResetCheck.method == "not-reset"``, ``GATEWAY_NOTE``).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import asdict, dataclass

import httpx

from chatfleet.bench.transport import Endpoint
from chatfleet.errors import ChatfleetError, ConfigError

RESET_PATHS = {"chatfleet": "/reset_prefix_cache", "vllm": "/reset_prefix_cache", "sglang": "/flush_cache"}
SERVER_KINDS = (*RESET_PATHS, "none")


GATEWAY_NOTE = ("{url} is a chatfleet gateway, which does not pass a prefix-cache reset on to its replicas: "
                "runs were not reset, so each starts with the cache the previous one left (early turns may hit "
                "more than from cold). Verified: every reply, its timing and the hit rates the replicas report. "
                "Not verified: a cold start per run; for that, bench each replica's own URL")


class ResetError(ChatfleetError):
    """The server's prefix cache could not be reset, or the reset could not be verified."""

    error_type = "reset_error"


class GatewayCannotReset(ResetError):
    """The URL is a chatfleet gateway that does not forward the reset."""


@dataclass(frozen=True)
class ResetCheck:
    server_kind: str
    method: str  # 'usage', 'metrics', 'skipped'
    cached_before: int | None  # probe's cached tokens on its second send, before the reset
    cached_after: int | None  # probe's cached tokens after the reset (must be 0)
    note: str

    def to_dict(self) -> dict:
        return asdict(self)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)", re.MULTILINE)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets}."""
    out: dict[str, float] = {}
    for name, _labels, value in _SAMPLE.findall(text):
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def counter(metrics: dict[str, float], base: str) -> float | None:
    for name in (base + "_total", base):
        if name in metrics:
            return metrics[name]
    return None


class ServerControl:
    def __init__(self, url: str, model: str, kind: str = "chatfleet", timeout_s: float = 60.0,
                 headers: dict[str, str] | None = None) -> None:
        if kind not in SERVER_KINDS:
            raise ConfigError(f"unknown server kind {kind!r}; valid: {', '.join(SERVER_KINDS)}")
        self.ep = Endpoint.parse(url)
        self.model, self.kind = model, kind
        self.http = httpx.AsyncClient(timeout=timeout_s, headers=headers or {})
        self._gateway: bool | None = None

    async def is_gateway(self) -> bool:
        """Is the URL a chatfleet gateway (it serves ``/gateway/status``)? Asked once."""
        if self._gateway is None:
            try:
                r = await self.http.get(self.ep.origin + "/gateway/status")
                self._gateway = r.status_code == 200 and isinstance(r.json(), dict) and "replicas" in r.json()
            except (httpx.HTTPError, ValueError):
                self._gateway = False
        return self._gateway

    async def close(self) -> None:
        await self.http.aclose()

    async def metrics(self) -> dict[str, float] | None:
        try:
            r = await self.http.get(self.ep.origin + "/metrics")
        except httpx.HTTPError:
            return None
        return parse_metrics(r.text) if r.status_code == 200 else None

    async def probe(self, text: str) -> int | None:
        """Send ``text`` as a one-token chat; returns the cached tokens it reports (None: unreported)."""
        body = {"model": self.model, "max_tokens": 1, "temperature": 0.0, "stream": False,
                "messages": [{"role": "system", "content": text}, {"role": "user", "content": "ok"}]}
        r = await self.http.post(self.ep.url("/v1/chat/completions"), json=body)
        if r.status_code != 200:
            raise ResetError(f"probe request failed with HTTP {r.status_code}: {r.text[:300]}")
        details = (r.json().get("usage") or {}).get("prompt_tokens_details") or {}
        return details.get("cached_tokens")

    async def _probe_hits(self, text: str) -> tuple[int | None, float | None]:
        before = await self.metrics()
        cached = await self.probe(text)
        after = await self.metrics()
        b, a = (counter(before, "vllm:prefix_cache_hits") if before else None,
                counter(after, "vllm:prefix_cache_hits") if after else None)
        return cached, (a - b if a is not None and b is not None else None)

    async def reset(self) -> None:
        path = RESET_PATHS.get(self.kind)
        if path is None:
            return
        try:
            r = await self.http.post(self.ep.origin + path)
        except httpx.HTTPError as e:
            raise ResetError(f"prefix-cache reset {path} failed: {e}") from e
        if r.status_code == 404 and await self.is_gateway():
            raise GatewayCannotReset(GATEWAY_NOTE.format(url=self.ep.origin))
        if r.status_code in (200, 502) and await self.is_gateway():
            return self._check_fleet_reset(path, r)
        if r.status_code == 401 and await self.is_gateway():
            raise ResetError(f"the gateway's {path} needs its admin key (the gateway's --admin-key): "
                             f"give it as --api-key (an admin key is also a tenant key there): {r.text[:300]}")
        if r.status_code != 200:
            hint = {"vllm": " (vLLM needs VLLM_SERVER_DEV_MODE=1 for it)",
                    "chatfleet": " (start the chatfleet engine with --enable-admin-api for it)"}.get(self.kind, "")
            raise ResetError(f"prefix-cache reset {path} answered HTTP {r.status_code}{hint}: {r.text[:300]}")
        try:
            body = r.json()
        except ValueError:
            return
        if isinstance(body, dict) and (body.get("success") is False or body.get("prefix_cache_empty") is False):
            raise ResetError(f"prefix-cache reset {path} did not empty the cache: {r.text[:300]}")

    @staticmethod
    def _check_fleet_reset(path: str, r: httpx.Response) -> None:
        """A gateway's report: every replica must have emptied its cache."""
        try:
            body = r.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("replicas"), list):
            raise ResetError(f"the gateway's {path} answered HTTP {r.status_code} without a per-replica "
                             f"report: {r.text[:300]}")
        failed = [rep for rep in body["replicas"] if isinstance(rep, dict) and not rep.get("success")]
        if not body["replicas"]:
            raise ResetError(f"the gateway's {path} reached no replica")
        if failed or body.get("success") is False or r.status_code != 200:
            named = "; ".join(f"{rep.get('url')}: {rep.get('error') or 'not reset'}" for rep in failed)
            raise ResetError(f"the gateway could not reset every replica's prefix cache ({named or r.text[:300]})")

    async def reset_verified(self, verify: bool = True) -> ResetCheck:
        """Reset the prefix cache and prove it is empty; raises ResetError otherwise."""
        if self.kind == "none":
            return ResetCheck("none", "skipped", None, None, "server kind 'none': no reset")
        if not verify:
            try:
                await self.reset()
            except GatewayCannotReset as e:
                return ResetCheck(self.kind, "not-reset", None, None, e.message)
            return ResetCheck(self.kind, "skipped", None, None, "reset sent, verification turned off")
        text = f"cache probe {uuid.uuid4().hex} " + " ".join(f"w{i} {uuid.uuid4().hex[:6]}" for i in range(64))
        await self.probe(text)
        cached1, hits1 = await self._probe_hits(text)
        try:
            await self.reset()
        except GatewayCannotReset as e:
            return ResetCheck(self.kind, "not-reset", cached1, None, e.message)
        cached2, hits2 = await self._probe_hits(text)
        if cached1 is not None and cached2 is not None:
            if cached2 > 0:
                raise ResetError(
                    f"prefix-cache reset did not empty the cache: a prompt sent before the reset still "
                    f"reports {cached2} cached tokens after it"
                )
            note = "verified by usage" if cached1 > 0 else "server shows no prefix caching; nothing to reset"
            return ResetCheck(self.kind, "usage", cached1, cached2, note)
        if hits1 is not None and hits2 is not None:
            if hits2 > 0:
                raise ResetError(
                    f"prefix-cache reset did not empty the cache: the probe hit {hits2:g} cached tokens "
                    "after the reset (vllm:prefix_cache_hits)"
                )
            note = "verified by metrics" if hits1 > 0 else "server shows no prefix caching; nothing to reset"
            return ResetCheck(self.kind, "metrics", int(hits1), int(hits2), note)
        raise ResetError(
            "cannot verify the prefix-cache reset: the server reports neither usage.prompt_tokens_details."
            "cached_tokens nor vllm:prefix_cache_hits on /metrics (vLLM: --enable-prompt-tokens-details); "
            "pass --no-verify-reset to run unverified"
        )
