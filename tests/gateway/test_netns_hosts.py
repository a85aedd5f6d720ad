"""Several hosts, for real: network namespaces joined by veth pairs to a bridge (in a namespace
of its own), each a host with its own address in 10.200.0.0/24 (only inside the namespaces this
test makes): a DNS server, two engines (fake replicas streaming slowly), two gateways
discovering the engines by DNS (``--replicas-from dns://...``, resolv.conf per namespace) and a
client. Mid-stream, one engine host's link goes down and its record leaves DNS. Then: every
stream ends with its whole reply or an explicit error (none cut silently), the streams on the
lost host end with an error, the lost replica's sessions re-home on the other engine through
either gateway, and both gateways forget the lost replica (the ring heals).

Needs root and ``ip netns`` (skipped with the reason otherwise)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chatfleet.gateway.routing import HashRing

HERE = Path(__file__).parent
PY = sys.executable
CHATFLEET = str(Path(PY).with_name("chatfleet"))
NAME = "engines.fleet.test"
PORT = 8000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Hosts:
    """Namespaces ``<prefix><host>`` on one bridge; ``add`` makes a host with an address."""

    def __init__(self) -> None:
        self.prefix = f"cf{os.getpid() % 100000}"
        self.bridge = self.prefix + "br"
        self.names: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def ns(self, host: str) -> str:
        return self.prefix + host

    def create_bridge(self) -> None:
        _ip("netns", "add", self.bridge)
        self.names.append(self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")

    def add(self, host: str, address: str) -> None:
        ns = self.ns(host)
        _ip("netns", "add", ns)
        self.names.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{host}", "netns", self.bridge)
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", self.bridge, "link", "set", f"p{host}", "master", "br0")
        _ip("-n", self.bridge, "link", "set", f"p{host}", "up")

    def cut(self, host: str) -> None:
        """The host's link goes down (its cable pulled at the switch)."""
        _ip("-n", self.bridge, "link", "set", f"p{host}", "down")

    def resolv(self, host: str, nameserver: str) -> None:
        folder = Path("/etc/netns") / self.ns(host)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "resolv.conf").write_text(f"nameserver {nameserver}\noptions timeout:1 attempts:1\n")

    def run(self, host: str, argv: list[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], **kw)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for name in reversed(self.names):
            _ip("netns", "del", name, check=False)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


@pytest.fixture
def hosts():
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): the network-namespace hosts test is skipped")
    probe = f"cfprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make network namespaces here ({made.stderr.strip() or 'not permitted'}): "
                    "the network-namespace hosts test is skipped")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    made_hosts = Hosts()
    try:
        made_hosts.create_bridge()
        yield made_hosts
    finally:
        made_hosts.close()


def _wait_line(proc: subprocess.Popen, expected: str, what: str) -> None:
    line = proc.stdout.readline()
    assert line.strip() == expected, f"{what}: {line!r}"


def test_a_host_cut_off_mid_stream(hosts, tmp_path):
    addresses = {"dns": "10.200.0.53", "e1": "10.200.0.11", "e2": "10.200.0.12",
                 "g1": "10.200.0.21", "g2": "10.200.0.22", "cl": "10.200.0.31"}
    for host, address in addresses.items():
        hosts.add(host, address)
    records = tmp_path / "records.json"
    records.write_text(json.dumps({NAME: [addresses["e1"], addresses["e2"]]}))
    dns = hosts.run("dns", [PY, str(HERE / "netns_dns.py"), addresses["dns"], str(records)],
                    stdout=subprocess.PIPE, text=True)
    _wait_line(dns, "READY", "the DNS server")
    for engine in ("e1", "e2"):  # 120 tokens at 40 ms: a stream lasts about 5 s
        hosts.run(engine, [PY, "-m", "chatfleet.testing.fake_server", "--host", addresses[engine], "--port",
                           str(PORT), "--ttft-ms", "20", "--itl-ms", "40"], stdout=subprocess.DEVNULL)
    profile = tmp_path / "gateway.yaml"
    profile.write_text(json.dumps({"gateway": {
        "replicas_from": f"dns://{NAME}:{PORT}?interval=0.5&timeout=1", "host": "0.0.0.0", "port": 8080,
        "health_interval_s": 0.5, "health_timeout_s": 1.0, "failure_threshold": 2,
        "connect_timeout_s": 1.0, "read_timeout_s": 2.0, "log_requests": False, "log_level": "warning"}}))
    for gateway in ("g1", "g2"):
        hosts.resolv(gateway, addresses["dns"])
        hosts.run(gateway, [CHATFLEET, "gateway", "--profile", str(profile)], stdout=subprocess.DEVNULL)

    lost, stays = (f"http://{addresses[e]}:{PORT}" for e in ("e1", "e2"))
    ring = HashRing([lost, stays])
    homes: dict[str, list[str]] = {lost: [], stays: []}
    for i in range(200):
        if all(len(v) == 3 for v in homes.values()):
            break
        key = f"chat{i}"
        if len(homes[ring.home(key)]) < 3:
            homes[ring.home(key)].append(key)
    sessions = homes[lost] + homes[stays]
    gateways = [f"http://{addresses[g]}:8080" for g in ("g1", "g2")]
    client = hosts.run("cl", [PY, str(HERE / "netns_driver.py"), *gateways, lost, stays, *sessions],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    _wait_line(client, "STARTED", "the client")
    hosts.cut("e1")
    records.write_text(json.dumps({NAME: [addresses["e2"]]}))  # its readiness lapses: it leaves DNS
    client.stdin.write("cut\n")
    client.stdin.flush()
    report = json.loads(client.stdout.readline())
    client.wait(30)

    streams, after = report["streams"], report["after"]
    assert sorted(streams) == sorted(sessions)
    for session, s in streams.items():
        assert s["exception"] is None and s["status"] == 200, (session, s)
        assert s["done"], f"{session}: the stream ended without [DONE] (a silent cut): {s}"
        complete = s["tokens"] == 120 and s["error"] is None
        assert complete or s["error"], f"{session}: {s['tokens']} tokens and no error (a silent loss): {s}"
        if s["replica"] == lost:
            assert s["error"] and not complete, f"{session} was on the cut host yet ended whole: {s}"
        else:
            assert complete, f"{session} on the healthy host did not complete: {s}"
    assert {s["replica"] for s in streams.values()} == {lost, stays}
    assert after == {s: {"status": 200, "replica": stays} for s in sessions}, after  # re-homed, via either
    assert report["healed"], "a gateway still lists the lost replica"
