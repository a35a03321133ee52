"""Admission control of one server: how many unary calls it has promised to answer, how
much of that one client may hold when the server is under pressure, and who a client is.

A refused call is RESOURCE_EXHAUSTED with a ``retry-after-ms`` hint (the interceptor in
:mod:`services.rpc.server` puts it in the trailing metadata). Two limits:

- the server's (``limit``): over it every call is refused;
- a client's share (``client_share`` of the limit): once the server is past its
  high-water mark, a client that already holds its share is refused its next call, so
  that one client's burst cannot take the room every other client needs. Below the
  high-water mark a lone client may use the whole limit (the share costs nothing when
  nobody else is waiting), and a client's first call is never refused by its share (a
  call that costs more than the share, a k=1000 search, is still admitted alone).

A client is its bearer token when it sends one (every connection of one token is one
client) and its connection otherwise (:func:`client_key`).

A call that waits without working (:func:`services.common.parking.parked`: a write paused
while a switch has closed the writer gates) lends its units back for the wait, up to the
limit's worth of parked units (:meth:`Admission.parked`): a switch's paused writes do not
refuse every client's searches, and what they hold is still bounded.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from services.common import errors
from services.common.parking import parking


class AdmissionRefused(errors.Overloaded):
    """Over the in-flight limit: RESOURCE_EXHAUSTED (as every Overloaded), with a hint of
    when to retry that the interceptor puts in the trailing metadata (``retry-after-ms``
    and ``grpc-retry-pushback-ms``)."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


def client_key(peer: str, metadata: Iterable[tuple[str, Any]] | None) -> str:
    """Who a call comes from, for the per-client share: ``token:<digest>`` of its bearer
    token when it sends one (the token itself is never kept), else its connection
    (``peer``: the transport's address and port)."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            return "token:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return "peer:" + peer


@dataclass
class _Call:
    """One admitted call's hold: what it took, and whether it has ended."""

    units: int
    client: str | None
    ended: bool = False
    parked: bool = False  # its units lent back now (a nested wait lends nothing more)


class Admission:
    """The in-flight limit of one server, and how close to it the server is.

    ``limit`` 0 admits everything. A call is counted from its admission to its end, so a
    search waiting in a shard or for a deadline holds its place: that is the point, the
    count is what the process has promised to answer. Above ``high_water`` (a share of
    the limit) :meth:`pressure` rises from 0 to 1 at the limit: optional work (the
    gateway's rerank) shrinks with it, before any call is refused; and a client holding
    ``client_share`` of the limit is refused more (see the module's docstring).

    ``cost`` (a request → how many of the limit's units it takes, at least 1; one call,
    one unit without it) lets a service count what a call costs rather than calls: the
    gateway counts a search by its hits (:func:`services.gateway.servicer.admission_cost`).
    Counted by calls, 32 searches at k=1000 (each ~1.5 MB of documents to fetch, convert
    and send) saturated the gateway's event loop, the calls queued in gRPC before the
    interceptor could refuse them, and of 1,000 concurrent ones 946 ended
    DEADLINE_EXCEEDED and 35 were refused; counted by hits 526 and 402
    (``bench/overload.py``, docs/architecture.md says what is left). A call that costs
    more than the whole limit is admitted alone. When not one unit is left (:meth:`full`)
    a call is refused from its headers, before its request is read.
    """

    def __init__(
        self,
        limit: int = 0,
        retry_after_ms: int = 100,
        high_water: float = 0.75,
        cost: Callable[[Any], int] | None = None,
        client_share: float = 0.5,
    ) -> None:
        self.limit = limit
        self.retry_after_ms = retry_after_ms
        self.high_water = int(limit * high_water)
        self.client_limit = max(1, int(limit * client_share)) if limit else 0
        self.in_flight = 0
        self.cost = cost
        self.by_client: dict[str, int] = {}
        self.refused_share = 0  # calls refused by a client's share (the rest: the limit)
        self.parked_units = 0  # lent back by calls waiting without work (at most ``limit``)

    @property
    def shares(self) -> bool:
        """Whether a client's share can refuse anything (a limit, and a share below it):
        without, callers need not name the client (no key built, nothing counted)."""
        return bool(self.limit) and self.client_limit < self.limit

    def pressure(self) -> float:
        """0 up to the high-water mark, then the used share of the room above it (1 at the
        limit); always 0 without a limit."""
        if not self.limit or self.in_flight <= self.high_water:
            return 0.0
        return min(1.0, (self.in_flight - self.high_water) / (self.limit - self.high_water))

    def units(self, request: Any) -> int:
        """What ``request`` takes of the limit: 1..limit (1 without a ``cost``)."""
        if self.cost is None or request is None or not self.limit:
            return 1
        return max(1, min(self.limit, int(self.cost(request))))

    def full(self) -> bool:
        """No room for even the cheapest call: what a call is refused on before its
        request is read (:meth:`ErrorAndLatencyInterceptor.wrap`)."""
        return bool(self.limit) and self.in_flight >= self.limit

    def refusal(self, units: int = 1) -> AdmissionRefused:
        takes = f"; this one takes {units}" if units > 1 else ""
        return AdmissionRefused(
            f"server busy: {self.in_flight} requests in flight (limit {self.limit}"
            f"{takes}); retry after {self.retry_after_ms} ms",
            self.retry_after_ms,
        )

    def _over_share(self, client: str | None, units: int) -> bool:
        if client is None or not self.limit or self.in_flight + units <= self.high_water:
            return False
        held = self.by_client.get(client, 0)
        return held > 0 and held + units > self.client_limit

    @contextlib.contextmanager
    def admit(self, request: Any = None, client: str | None = None) -> Iterator[None]:
        """Hold ``request``'s units (and ``client``'s, when named) until the block ends;
        refused at once when over the limit or over the client's share."""
        units = self.units(request)
        if self.limit and self.in_flight + units > self.limit:
            raise self.refusal(units)
        if self._over_share(client, units):
            self.refused_share += 1
            raise AdmissionRefused(
                f"server busy and this client holds {self.by_client[client or '']} of the "
                f"{self.limit} units in flight (a client's share under load: "
                f"{self.client_limit}); retry after {self.retry_after_ms} ms",
                self.retry_after_ms,
            )
        self._take(units, client)
        call = _Call(units, client)
        try:
            with parking(lambda: self.parked(call)):
                yield
        finally:
            call.ended = True
            self._give(units, client)

    @contextlib.contextmanager
    def parked(self, call: _Call) -> Iterator[None]:
        """An admitted ``call``'s units lent back while it waits without working, and
        taken again (never refused: the call was admitted) when it goes on. Kept when
        lending them would park more than ``limit`` units (past that, waiting calls count
        again, and the server refuses as before), and for a call that has ended (a
        context that outlived it)."""
        room = self.parked_units + call.units <= self.limit
        if call.ended or call.parked or not self.limit or not room:
            yield
            return
        self._give(call.units, call.client)
        self.parked_units += call.units
        call.parked = True
        try:
            yield
        finally:
            call.parked = False
            self.parked_units -= call.units
            self._take(call.units, call.client)

    def _take(self, units: int, client: str | None) -> None:
        self.in_flight += units
        if client is not None:
            self.by_client[client] = self.by_client.get(client, 0) + units

    def _give(self, units: int, client: str | None) -> None:
        self.in_flight -= units
        if client is not None:
            left = self.by_client[client] - units
            if left:
                self.by_client[client] = left
            else:
                del self.by_client[client]
