"""A real DNS server (UDP, on a free port) whose A records a test changes while it runs.

Stands in for the cluster DNS that resolves a shard's headless Service to its ready pods
(which cannot run here): the router and the seeding replica ask it over the wire, as
they would ask CoreDNS, through a ``dns://127.0.0.1:<port>/<name>:<port>`` target::

    with run_dns() as dns:
        dns.set("shard-0.test", ["127.0.0.2", "127.0.0.3"])
        target = dns.target("shard-0.test", 50061)
        dns.set("shard-0.test", ["127.0.0.2"])      # a pod went away
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class DnsServer:
    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = int(self._sock.getsockname()[1])
        self._records: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.queries = 0
        self._thread = threading.Thread(target=self._serve, name="test-dns", daemon=True)
        self._thread.start()

    def set(self, name: str, ips: list[str]) -> None:
        with self._lock:
            self._records[name.rstrip(".").lower()] = list(ips)

    def target(self, name: str, port: int) -> str:
        return f"dns://127.0.0.1:{self.port}/{name}:{port}"

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        question = query.question[0]
        name = question.name.to_text().rstrip(".").lower()
        with self._lock:
            ips = self._records.get(name)
        if ips is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A and ips:
            response.answer.append(dns.rrset.from_text_list(question.name, 1, "IN", "A", ips))
        return response

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                query = dns.message.from_wire(data)
            except dns.exception.DNSException:
                continue
            self.queries += 1
            self._sock.sendto(self._answer(query).to_wire(), peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


@contextmanager
def run_dns() -> Iterator[DnsServer]:
    server = DnsServer()
    try:
        yield server
    finally:
        server.close()
