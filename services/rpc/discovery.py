"""Where the servers behind one name are: a fixed list of addresses, or a DNS name
re-resolved (:mod:`services.rpc.balance` balances over them: a shard's replicas in the
index router, Triton's servers in the gateway's encoder).

A name is either a list of addresses (``host:port,host:port``) or one DNS target in
gRPC's syntax, ``dns:[//authority/]host:port`` (``dns:///gtr-shard-0-headless.ns.svc:50061``
in the chart: the headless Service of the shard's StatefulSet, whose A records are the
pods that are ready). Each address a name resolves to is one server (its own channel),
so the client balances over the servers itself instead of leaving one gRPC channel to
pick the first address and keep it.

Without an authority the name goes through the system resolver (``getaddrinfo``: what
the pod's ``/etc/resolv.conf`` and ``/etc/hosts`` say, search domains included); with
one (``dns://10.96.0.10:53/name:port``) it is asked of that DNS server directly
(dnspython), A and AAAA records.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.resolver

from services.common.errors import Unavailable

SCHEME = "dns:"


@dataclass(frozen=True)
class DnsTarget:
    host: str
    port: int
    nameserver: str | None = None  # the authority's address, None = the system resolver
    nameserver_port: int = 53

    def __str__(self) -> str:
        authority = ""
        if self.nameserver is not None:
            authority = grpc_address(self.nameserver, self.nameserver_port)
        return f"{SCHEME}//{authority}/{self.host}:{self.port}"


def is_dns_target(spec: str) -> bool:
    return spec.strip().startswith(SCHEME)


def _host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {text!r} is not host:port")
    return host, int(port)


def parse_addresses(spec: str, what: str) -> list[str]:
    """``host:port[,host:port...]`` or one ``dns:`` target → the addresses, as given;
    ValueError saying what is wrong (``what`` names the servers: "a shard", "Triton")."""
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    if not addresses:
        raise ValueError(f"{what}: expected 'host:port[,host:port...]' or 'dns:///name:port'")
    if any(is_dns_target(a) for a in addresses):
        if len(addresses) != 1:
            raise ValueError(f"{spec!r}: a dns: target names {what} alone")
        parse_dns_target(addresses[0])
        return addresses
    for address in addresses:
        _host_port(address, "address")
    return addresses


def parse_dns_target(spec: str) -> DnsTarget:
    """``dns:///host:port``, ``dns:host:port`` or ``dns://ns-ip[:port]/host:port``."""
    rest = spec.strip()[len(SCHEME) :]
    nameserver: str | None = None
    ns_port = 53
    if rest.startswith("//"):
        authority, sep, rest = rest[2:].partition("/")
        if not sep:
            raise ValueError(f"{spec!r}: expected dns://[authority]/host:port")
        if authority.count(":") == 1 or authority.startswith("["):
            if authority.endswith("]"):
                nameserver = authority.strip("[]")
            else:
                nameserver, ns_port = _host_port(authority, "DNS server")
        elif authority:
            nameserver = authority  # a host name, or a bare IPv6 address
    host, port = _host_port(rest, "DNS target")
    return DnsTarget(host, port, nameserver, ns_port)


def grpc_address(ip: str, port: int) -> str:
    """``ip:port`` as a gRPC target (IPv6 in brackets)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def resolve(target: DnsTarget, timeout: float = 2.0) -> list[str]:
    """The target's addresses as sorted ``ip:port`` gRPC targets (no duplicates).

    A name without address (NXDOMAIN or no record: a headless Service with no ready pod)
    is an empty list; Unavailable when no answer came (a timeout, SERVFAIL, a resolver
    that cannot be reached).
    """
    try:
        async with asyncio.timeout(timeout):
            if target.nameserver is None:
                ips = await _system(target)
            else:
                ips = await _nameserver(target, timeout)
    except TimeoutError:
        raise Unavailable(f"resolving {target}: no answer within {timeout:g} s") from None
    except (OSError, dns.exception.DNSException) as exc:
        raise Unavailable(f"resolving {target}: {exc}") from exc
    return sorted({grpc_address(ip, target.port) for ip in ips})


async def _system(target: DnsTarget) -> list[str]:
    if _is_ip(target.host):
        return [target.host]
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            target.host, target.port, type=socket.SOCK_STREAM
        )
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5)):
            return []  # the name exists without address, or not (yet): no replica
        raise
    return [str(info[4][0]) for info in infos]


async def _nameserver(target: DnsTarget, timeout: float) -> list[str]:
    if _is_ip(target.host):
        return [target.host]
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [target.nameserver or ""]
    resolver.port = target.nameserver_port
    resolver.lifetime = timeout
    ips: list[str] = []
    for rdtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(target.host, rdtype, search=False)
        except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
            continue
        ips.extend(rr.address for rr in answer)
    return ips


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
