"""A shard named by a DNS target: the forms accepted, and what a real DNS server's answers
become (services/rpc/discovery.py, the gateway's --shards)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from services.common.errors import Unavailable
from services.index.client.addresses import parse_shard_addresses
from services.rpc.discovery import DnsTarget, parse_dns_target, resolve
from tests.support.dns import run_dns


@pytest.mark.parametrize(
    ("spec", "target"),
    [
        (
            "dns:///gtr-shard-0-headless.ns.svc:50061",
            DnsTarget("gtr-shard-0-headless.ns.svc", 50061),
        ),
        ("dns:shard-0:7", DnsTarget("shard-0", 7)),
        ("dns://10.96.0.10/shard-0.test:7", DnsTarget("shard-0.test", 7, "10.96.0.10")),
        ("dns://127.0.0.1:5353/a.b:2", DnsTarget("a.b", 2, "127.0.0.1", 5353)),
        ("dns://[::1]:5353/a:3", DnsTarget("a", 3, "::1", 5353)),
    ],
)
def test_dns_target_forms(spec: str, target: DnsTarget) -> None:
    assert parse_dns_target(spec) == target


@pytest.mark.parametrize("spec", ["dns:///name", "dns:///name:0", "dns:///:50061", "dns://x"])
def test_malformed_dns_targets_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_dns_target(spec)


def test_the_gateway_takes_a_dns_target_per_shard_beside_address_lists() -> None:
    assert parse_shard_addresses("a:1,b:2;dns:///s1.ns.svc:50061") == [
        ["a:1", "b:2"],
        ["dns:///s1.ns.svc:50061"],
    ]
    with pytest.raises(ValueError, match="alone"):
        parse_shard_addresses("dns:///s0:1,a:2")
    with pytest.raises(ValueError, match="not host:port"):
        parse_shard_addresses("dns:///s0")


def test_the_gateway_takes_tritons_as_a_list_or_one_dns_target() -> None:
    from services.encoder.runtime.triton_client import triton_addresses

    assert triton_addresses("a:8001") == ["a:8001"]
    assert triton_addresses("a:8001, b:8001") == ["a:8001", "b:8001"]
    assert triton_addresses("dns:///t.ns.svc:8001") == ["dns:///t.ns.svc:8001"]
    with pytest.raises(ValueError, match="alone"):
        triton_addresses("dns:///t:1,a:2")
    with pytest.raises(ValueError, match="not host:port"):
        triton_addresses("a:8001,b")
    with pytest.raises(ValueError):
        triton_addresses("dns:///t")


def test_a_gateway_with_a_malformed_triton_list_does_not_start() -> None:
    from pydantic import ValidationError

    from services.gateway.settings import GatewaySettings

    ok = GatewaySettings(shards="a:1", auth=False, triton_url="dns:///t.ns.svc:8001")
    assert ok.triton_url == "dns:///t.ns.svc:8001"
    with pytest.raises(ValidationError, match="triton_url"):
        GatewaySettings(shards="a:1", auth=False, triton_url="a:8001,b")


def test_a_name_resolves_to_its_addresses_and_follows_changes() -> None:
    with run_dns() as dns:
        target = parse_dns_target(dns.target("shard-0.test", 50061))
        dns.set("shard-0.test", ["127.0.0.3", "127.0.0.2"])
        assert asyncio.run(resolve(target)) == ["127.0.0.2:50061", "127.0.0.3:50061"]
        dns.set("shard-0.test", ["127.0.0.3"])
        assert asyncio.run(resolve(target)) == ["127.0.0.3:50061"]
        dns.set("shard-0.test", [])  # a headless Service with no ready pod
        assert asyncio.run(resolve(target)) == []
        unknown = parse_dns_target(dns.target("nobody.test", 1))
        assert asyncio.run(resolve(unknown)) == []  # NXDOMAIN


def test_a_dns_server_that_does_not_answer_is_unavailable() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))  # receives, never answers
        port = silent.getsockname()[1]
        target = parse_dns_target(f"dns://127.0.0.1:{port}/shard-0.test:1")
        with pytest.raises(Unavailable, match=r"shard-0\.test"):
            asyncio.run(resolve(target, timeout=0.3))


def test_the_system_resolver_serves_names_without_authority() -> None:
    assert asyncio.run(resolve(parse_dns_target("dns:///localhost:9"))) != []
    assert asyncio.run(resolve(parse_dns_target("dns:///127.0.0.1:9"))) == ["127.0.0.1:9"]


def test_a_search_waits_for_the_first_resolution_only_within_its_deadline() -> None:
    from retrieval.v1 import index_pb2
    from services.common.deadline import Deadline
    from services.common.errors import DeadlineExceeded
    from services.index.client.replicas import ReplicaSet
    from services.rpc.balance import Balancing

    async def main() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
            silent.bind(("127.0.0.1", 0))  # receives, never answers
            port = silent.getsockname()[1]
            shard = ReplicaSet(
                0,
                [f"dns://127.0.0.1:{port}/shard-0.test:1"],
                balancing=Balancing(resolve_timeout_s=5.0),
            )
            try:
                with pytest.raises(DeadlineExceeded, match="not resolved"):
                    await shard.search(index_pb2.ShardSearchRequest(), Deadline.after(0.2))
            finally:
                await shard.close()

    asyncio.run(main())  # without the bound: Unavailable after the 5 s resolve timeout


def test_an_unexpected_resolver_error_does_not_end_the_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.index.client.replicas import ReplicaSet
    from services.rpc import balance as balance_module
    from services.rpc.balance import Balancing

    answers: list[object] = [RuntimeError("surprise"), ["127.0.0.1:9"]]

    async def fake_resolve(target: DnsTarget, timeout: float) -> list[str]:
        answer = answers.pop(0) if answers else ["127.0.0.1:9"]
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, list)
        return answer

    monkeypatch.setattr(balance_module, "resolve", fake_resolve)

    async def main() -> list[str]:
        shard = ReplicaSet(0, ["dns:///shard-0.test:9"], balancing=Balancing(resolve_every_s=0.01))
        try:
            # the first answer was the error
            assert await asyncio.wait_for(shard.current(), 5.0) == []
            for _ in range(100):
                await asyncio.sleep(0.01)
                if shard.replicas:
                    break
            return [r.address for r in shard.replicas]
        finally:
            await shard.close()

    assert asyncio.run(main()) == ["127.0.0.1:9"]


def test_closing_a_shard_closes_the_replicas_that_left_dns_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.index.client.replicas import Replica, ReplicaSet

    closed: list[str] = []
    close = Replica.close

    async def recorded(self: Replica) -> None:
        closed.append(self.address)
        await close(self)

    monkeypatch.setattr(Replica, "close", recorded)

    async def main() -> None:
        shard = ReplicaSet(0, ["dns:///shard-0.test:9"])
        shard.update(["127.0.0.1:9"])
        shard.replicas[0].sent()  # a search still waits on it: it is retired, not closed
        shard.update(["127.0.0.2:9"])
        await asyncio.sleep(0)
        assert closed == []
        await shard.close()

    asyncio.run(main())
    assert sorted(closed) == ["127.0.0.1:9", "127.0.0.2:9"]
