"""The order in which an :class:`EndpointPool` asks its servers (services/rpc/balance.py),
the rule both the index router's replicas and the gateway's Tritons follow: fewest calls
in flight first (least_outstanding), ties in turn, suspect servers last; round_robin
strictly in turn. The integration tests drive it over real servers, where the split also
depends on how the cores run them; here the counts are set, so the order is exact."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.rpc import balance
from services.rpc.balance import Balancing, Endpoint, EndpointPool


class _Server(Endpoint):
    def __init__(self, address: str) -> None:
        super().__init__(address, f"test {address}", suspect_after=3, probe_every_s=60.0)

    async def serving(self) -> bool:
        return True


def _pool(
    n: int, mode: Literal["least_outstanding", "round_robin"] = "least_outstanding"
) -> EndpointPool[_Server]:
    addresses = [f"10.0.0.{i}:1" for i in range(n)]
    return EndpointPool("test", addresses, _Server, Balancing(mode))


def _in_flight(server: _Server, calls: int) -> None:
    for _ in range(calls):
        server.sent()


def test_the_server_with_fewest_calls_in_flight_is_asked_first() -> None:
    pool = _pool(3)
    a, b, c = pool.endpoints
    _in_flight(a, 2)
    _in_flight(c, 1)
    for _ in range(6):  # whatever the turn
        assert pool.order(pool.endpoints) == [b, c, a]
    _in_flight(b, 3)  # b now holds the most: c, a, b
    assert pool.order(pool.endpoints) == [c, a, b]
    b.done()
    b.done()  # b back to one, tied with c: in turn, before a
    assert pool.order(pool.endpoints)[2] is a


def test_ties_go_in_turn() -> None:
    pool = _pool(3)
    firsts = Counter(pool.order(pool.endpoints)[0].address for _ in range(30))
    assert firsts == Counter({e.address: 10 for e in pool.endpoints})


def test_a_suspect_server_is_asked_last_however_idle() -> None:
    pool = _pool(3)
    a, b, c = pool.endpoints
    _in_flight(a, 5)
    _in_flight(c, 5)
    b.suspect = True  # what missed() sets after suspect_after misses in a row
    for _ in range(6):
        order = pool.order(pool.endpoints)
        assert order[-1] is b and set(order[:2]) == {a, c}


def test_round_robin_ignores_the_calls_in_flight() -> None:
    pool = _pool(2, "round_robin")
    a, b = pool.endpoints
    _in_flight(a, 10)
    firsts = [pool.order(pool.endpoints)[0] for _ in range(4)]
    assert firsts == [a, b, a, b]


@pytest.mark.parametrize("n", [2, 5])
@given(data=st.data())
def test_every_order_asks_each_server_once_fewest_in_flight_first(
    n: int, data: st.DataObject
) -> None:
    pool = _pool(n)
    for server in pool.endpoints:
        _in_flight(server, data.draw(st.integers(0, 4)))
        server.suspect = data.draw(st.booleans())
    order = pool.order(pool.endpoints)
    assert sorted(e.address for e in order) == sorted(e.address for e in pool.endpoints)
    healthy = [e for e in order if not e.suspect]
    assert order[: len(healthy)] == healthy  # suspect ones last
    counts = [e.outstanding for e in healthy]
    assert counts == sorted(counts)


def test_a_fixed_list_is_known_at_once_a_dns_target_once_resolved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call's fast path (no timer around the wait) holds only when nothing is to be
    waited for: a fixed list always, a ``dns:`` target after its first resolution."""
    fixed = _pool(2)
    assert fixed.known() == fixed.endpoints and len(fixed.endpoints) == 2

    async def resolve(target: object, timeout: float) -> list[str]:
        return ["10.0.0.1:7", "10.0.0.2:7"]

    monkeypatch.setattr(balance, "resolve", resolve)
    named = EndpointPool("test", ["dns:///shard-0.test:7"], _Server)
    assert named.known() is None  # not resolved yet: a call waits within its deadline

    async def first_call() -> list[str]:
        servers = await named.current()
        known = named.known()
        assert known is not None and known == servers
        return [s.address for s in known]

    assert asyncio.run(first_call()) == ["10.0.0.1:7", "10.0.0.2:7"]
