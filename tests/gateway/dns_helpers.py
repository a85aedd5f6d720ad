"""A DNS server on loopback for the discovery tests (imported by name; tests/gateway is on sys.path)."""

from __future__ import annotations

import socket
import threading

import dns.asyncresolver
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class LoopbackDns:
    """A UDP DNS server on 127.0.0.1 answering A queries from ``records`` (name -> addresses);
    a name not there is NXDOMAIN; ``silent`` makes it drop every query (a resolver timeout)."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.silent = False
        self.queries = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            self.queries += 1
            if self.silent:
                continue
            query = dns.message.from_wire(data)
            reply = dns.message.make_response(query)
            question = query.question[0]
            name = question.name.to_text().rstrip(".")
            if name not in self.records:
                reply.set_rcode(dns.rcode.NXDOMAIN)
            elif question.rdtype == dns.rdatatype.A and self.records[name]:
                reply.answer.append(dns.rrset.from_text_list(question.name, 5, "IN", "A", self.records[name]))
            self.sock.sendto(reply.to_wire(), peer)

    def resolver(self) -> dns.asyncresolver.Resolver:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = ["127.0.0.1"]
        resolver.port = self.port
        return resolver

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()
