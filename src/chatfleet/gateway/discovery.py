"""Replica discovery: where the gateway learns its replicas on a cluster (``--replicas-from``).

Two sources, each yielding the current replica set as a frozen value whenever it changes:

- ``dns://HOST:PORT[?interval=SECONDS&timeout=SECONDS]``: the A and AAAA records of HOST (a
  headless Service has one per Ready pod), re-resolved every ``interval`` seconds (default 5),
  each lookup given ``timeout`` seconds (default 5, apart from the interval: a short interval on
  a loaded machine must not turn slow answers into failures). The resolv.conf
  search path applies, so ``dns://chatfleet-engine:8000`` finds the Service in the gateway's
  own namespace. A name that does not exist or has no records is an empty set (a headless
  Service with no Ready pod); a resolver that fails or times out keeps the last set, so a DNS
  hiccup never drains the fleet.
- ``k8s://NAMESPACE/SERVICE[:PORT_NAME]``: the Service's EndpointSlices, listed then watched
  through the official ``kubernetes`` client (``pip install 'chatfleet[k8s]'``), in-cluster
  config by default. An endpoint counts while its ``ready`` condition holds (unset means ready,
  as the API says); a terminating or unready one leaves the set, so it drains. The port is the
  slice port named PORT_NAME, else the slice's only (or first) port.

Each replica is ``http://ADDRESS:PORT``; sets are sorted, so every gateway that sees the same
records holds the same set and builds the same ring.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

import dns.asyncresolver
import dns.exception
import dns.resolver

from chatfleet.errors import ConfigError

log = logging.getLogger("chatfleet.gateway")

DEFAULT_DNS_INTERVAL_S = 5.0
DEFAULT_DNS_TIMEOUT_S = 5.0
K8S_WATCH_TIMEOUT_S = 60  # the API server ends a watch after this; it is then resumed


@dataclass(frozen=True)
class DiscoveredReplicas:
    """One observation of the replica set: sorted, distinct base URLs (no /v1)."""

    urls: tuple[str, ...]
    source: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "urls", tuple(sorted(set(self.urls))))


def replica_url(address: str, port: int, scheme: str = "http") -> str:
    """``http://10.0.0.7:8000``; IPv6 addresses in brackets."""
    try:
        if ipaddress.ip_address(address).version == 6:
            address = f"[{address}]"
    except ValueError:
        pass  # a host name
    return f"{scheme}://{address}:{port}"


@dataclass(frozen=True)
class DnsSource:
    host: str
    port: int
    interval_s: float = DEFAULT_DNS_INTERVAL_S
    timeout_s: float = DEFAULT_DNS_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"dns:// discovery timeout must be > 0, got {self.timeout_s}")
        if not self.host:
            raise ConfigError("dns:// discovery needs a host name")
        if not 0 < self.port < 65536:
            raise ConfigError(f"dns:// discovery port must be in 1..65535, got {self.port}")
        if not self.interval_s > 0:
            raise ConfigError(f"dns:// discovery interval must be > 0, got {self.interval_s}")

    def __str__(self) -> str:
        return f"dns://{self.host}:{self.port}"


@dataclass(frozen=True)
class K8sSource:
    namespace: str
    service: str
    port_name: str | None = None

    def __post_init__(self) -> None:
        if not self.namespace or not self.service:
            raise ConfigError("k8s:// discovery needs k8s://NAMESPACE/SERVICE[:PORT_NAME]")

    def __str__(self) -> str:
        return f"k8s://{self.namespace}/{self.service}" + (f":{self.port_name}" if self.port_name else "")


def parse_source(text: str) -> DnsSource | K8sSource:
    """``dns://HOST:PORT[?interval=S]`` or ``k8s://NAMESPACE/SERVICE[:PORT_NAME]``."""
    parts = urlsplit(text.strip())
    if parts.scheme == "dns":
        if parts.port is None or not parts.hostname:
            raise ConfigError(f"{text!r}: dns:// discovery needs dns://HOST:PORT")
        query = parse_qs(parts.query)
        unknown = sorted(set(query) - {"interval", "timeout"})
        if unknown:
            raise ConfigError(f"{text!r}: unknown dns:// option(s) {unknown}; valid: ['interval', 'timeout']")
        try:
            interval = float(query["interval"][-1]) if "interval" in query else DEFAULT_DNS_INTERVAL_S
            timeout = float(query["timeout"][-1]) if "timeout" in query else DEFAULT_DNS_TIMEOUT_S
        except ValueError:
            raise ConfigError(f"{text!r}: dns:// interval and timeout are seconds") from None
        return DnsSource(parts.hostname, parts.port, interval, timeout)
    if parts.scheme == "k8s":
        service, _, port_name = parts.path.strip("/").partition(":")
        if "/" in service or parts.query:
            raise ConfigError(f"{text!r}: k8s:// discovery needs k8s://NAMESPACE/SERVICE[:PORT_NAME]")
        return K8sSource(parts.netloc, service, port_name or None)
    raise ConfigError(f"{text!r}: replica discovery must be dns://HOST:PORT or k8s://NAMESPACE/SERVICE")


class Discovery(Protocol):
    def changes(self) -> AsyncIterator[DiscoveredReplicas]:
        """The first set once known, then each set that differs from the one before."""
        ...


async def _distinct(sets: AsyncGenerator[DiscoveredReplicas, None]) -> AsyncIterator[DiscoveredReplicas]:
    last: tuple[str, ...] | None = None
    try:
        async for found in sets:
            if found.urls != last:
                last = found.urls
                yield found
    finally:
        await sets.aclose()  # at once, not whenever the loop finalizes it (the k8s thread stops)


class DnsDiscovery:
    """Re-resolves a name every interval; see the module doc for what errors do."""

    def __init__(self, source: DnsSource, resolver: dns.asyncresolver.Resolver | None = None) -> None:
        self.source = source
        self.resolver = resolver or dns.asyncresolver.Resolver()

    async def resolve(self) -> DiscoveredReplicas | None:
        """The current set, or None when the resolver failed (keep the last set)."""
        addresses: list[str] = []
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self.resolver.resolve(self.source.host, rdtype, search=True,
                                                     lifetime=self.source.timeout_s)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            except dns.exception.DNSException as exc:  # timeout, no nameserver answered, ...
                log.warning("discovery %s: %s resolution failed (%s); keeping the last replica set",
                            self.source, rdtype, exc)
                return None
            addresses.extend(record.address for record in answer)
        return DiscoveredReplicas(tuple(replica_url(a, self.source.port) for a in addresses), str(self.source))

    async def _every_interval(self) -> AsyncGenerator[DiscoveredReplicas, None]:
        while True:
            found = await self.resolve()
            if found is not None:
                yield found
            await asyncio.sleep(self.source.interval_s)

    def changes(self) -> AsyncIterator[DiscoveredReplicas]:
        return _distinct(self._every_interval())


# -- Kubernetes EndpointSlices ---------------------------------------------------------------

SERVICE_LABEL = "kubernetes.io/service-name"
ApiObject = Mapping[str, Any]  # an object as the API server sends it (JSON)


def slice_urls(endpoint_slice: ApiObject, port_name: str | None) -> list[str]:
    """Base URLs of the ready endpoints of one EndpointSlice (a plain API object)."""
    if endpoint_slice.get("addressType") not in ("IPv4", "IPv6"):
        return []  # FQDN slices name hosts the gateway would have to resolve again
    ports = endpoint_slice.get("ports") or []
    if port_name is not None:
        ports = [p for p in ports if p.get("name") == port_name]
    port = next((p.get("port") for p in ports if p.get("port")), None)
    if port is None:
        return []
    urls = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        addresses = endpoint.get("addresses") or []
        if addresses:  # the addresses of one endpoint are fungible: the first is enough
            urls.append(replica_url(addresses[0], int(port)))
    return urls


def _k8s_api(api_host: str | None, kubeconfig: str | None) -> Any:
    """A DiscoveryV1Api: in-cluster config, else a kubeconfig; ``api_host`` overrides both."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ConfigError("k8s:// discovery needs the kubernetes client: pip install 'chatfleet[k8s]'") from None
    if api_host is not None:
        configuration = client.Configuration()
        configuration.host = api_host
        return client.DiscoveryV1Api(client.ApiClient(configuration))
    try:
        if kubeconfig is not None:
            raise config.ConfigException("a kubeconfig was given")
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        try:
            config.load_kube_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        except (config.ConfigException, OSError) as exc:
            raise ConfigError(f"k8s:// discovery: no in-cluster config and no kubeconfig ({exc})") from None
    return client.DiscoveryV1Api()


class K8sDiscovery:
    """Lists the Service's EndpointSlices, then watches them (resuming, relisting after errors).

    The client is synchronous: a daemon thread runs it and hands each observed set to the loop.
    """

    def __init__(self, source: K8sSource, *, api_host: str | None = None, kubeconfig: str | None = None,
                 retry_s: float = 2.0, watch_timeout_s: int = K8S_WATCH_TIMEOUT_S) -> None:
        self.source = source
        self.api = _k8s_api(api_host, kubeconfig)
        self.retry_s = retry_s
        self.watch_timeout_s = watch_timeout_s

    def _set(self, slices: Mapping[str, ApiObject]) -> DiscoveredReplicas:
        urls = [u for s in slices.values() for u in slice_urls(s, self.source.port_name)]
        return DiscoveredReplicas(tuple(urls), str(self.source))

    def _list(self) -> tuple[dict[str, ApiObject], str]:
        response = self.api.list_namespaced_endpoint_slice(
            self.source.namespace, label_selector=f"{SERVICE_LABEL}={self.source.service}",
            _preload_content=False, _request_timeout=10)
        body = json.loads(response.data)
        slices = {item["metadata"]["name"]: item for item in body.get("items") or []}
        return slices, body.get("metadata", {}).get("resourceVersion", "")

    def _follow(self, publish: Callable[[DiscoveredReplicas], None], stop: threading.Event) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        slices: dict[str, ApiObject] | None = None
        version = ""
        while not stop.is_set():
            try:
                if slices is None:
                    slices, version = self._list()
                    publish(self._set(slices))
                stream = watch.Watch().stream(  # type: ignore[no-untyped-call]
                    self.api.list_namespaced_endpoint_slice, self.source.namespace,
                    label_selector=f"{SERVICE_LABEL}={self.source.service}", resource_version=version,
                    allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout_s,
                    _request_timeout=self.watch_timeout_s + 10)
                for event in stream:
                    if stop.is_set():
                        return
                    kind, obj = event["type"], event["raw_object"]
                    version = obj.get("metadata", {}).get("resourceVersion", version)
                    if kind == "BOOKMARK":
                        continue
                    name = obj["metadata"]["name"]
                    if kind == "DELETED":
                        slices.pop(name, None)
                    else:
                        slices[name] = obj
                    publish(self._set(slices))
            except ApiException as exc:  # an ERROR event or status; 410 Gone: list again at once
                if exc.status == 410:
                    slices = None
                    continue
                log.warning("discovery %s: API error %s; keeping the last replica set", self.source, exc.status)
                slices = None
                stop.wait(self.retry_s)
            except Exception as exc:  # connection refused, reset, timed out: retry, keep the last set
                log.warning("discovery %s: %s; keeping the last replica set", self.source, exc)
                slices = None
                stop.wait(self.retry_s)

    async def _observed(self) -> AsyncGenerator[DiscoveredReplicas, None]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[DiscoveredReplicas] = asyncio.Queue()
        stop = threading.Event()

        def publish(found: DiscoveredReplicas) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed while the thread was reading
                loop.call_soon_threadsafe(queue.put_nowait, found)

        thread = threading.Thread(target=self._follow, args=(publish, stop), daemon=True,
                                  name=f"discovery {self.source}")
        thread.start()
        try:
            while True:
                yield await queue.get()
        finally:
            stop.set()

    def changes(self) -> AsyncIterator[DiscoveredReplicas]:
        return _distinct(self._observed())


def discovery_for(source: str | DnsSource | K8sSource, *, api_host: str | None = None,
                  kubeconfig: str | None = None) -> Discovery:
    """The discovery for a ``--replicas-from`` value (``api_host``, ``kubeconfig``: k8s:// only)."""
    parsed = parse_source(source) if isinstance(source, str) else source
    if isinstance(parsed, DnsSource):
        return DnsDiscovery(parsed)
    return K8sDiscovery(parsed, api_host=api_host, kubeconfig=kubeconfig)


def describe(found: DiscoveredReplicas, before: Iterable[str]) -> str:
    """'+http://a:8000 -http://b:8000' for the log."""
    old, new = set(before), set(found.urls)
    return " ".join([f"+{u}" for u in sorted(new - old)] + [f"-{u}" for u in sorted(old - new)]) or "no change"
