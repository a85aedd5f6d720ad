"""A DNS server for test_netns_hosts.py, run inside its own network namespace.

argv: BIND_ADDRESS RECORDS_JSON. Answers A queries from the JSON file ({name: [addresses]}),
read afresh for every query so the test changes the records by rewriting it; other names are
NXDOMAIN.
"""

from __future__ import annotations

import json
import socket
import sys

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


def main() -> None:
    address, records_path = sys.argv[1:3]
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((address, 53))
    print("READY", flush=True)
    while True:
        data, peer = sock.recvfrom(4096)
        try:
            query = dns.message.from_wire(data)
        except Exception:  # noqa: BLE001 - not a DNS query
            continue
        with open(records_path) as f:
            records = json.load(f)
        reply = dns.message.make_response(query)
        question = query.question[0]
        name = question.name.to_text().rstrip(".")
        if name not in records:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A and records[name]:
            reply.answer.append(dns.rrset.from_text_list(question.name, 1, "IN", "A", records[name]))
        sock.sendto(reply.to_wire(), peer)


if __name__ == "__main__":
    main()
