"""Balancing over the servers behind one name: a shard's replicas (the index router),
Triton's servers (the gateway's encoder).

gRPC keeps one HTTP/2 connection per channel, so one channel to a Kubernetes Service
sends all of a client's calls to one pod. Instead each server is an :class:`Endpoint`
with a channel of its own, and an :class:`EndpointPool` chooses among them per call:

* **which servers**: a fixed list of addresses, or the addresses a DNS name resolves to
  (:mod:`services.rpc.discovery`; the chart's headless Service), resolved again every
  ``resolve_every_s``. A server that appears is asked last until its health check says
  it serves; one that disappears gets no new call and is closed once its calls ended.
* **in which order**: the one with the fewest calls outstanding from this process
  (ties in turn), or strictly in turn (:class:`Balancing`); suspect ones last.
* **whom to avoid**: a server that keeps failing (``suspect_after`` misses in a row: a
  refused connection, a call that timed out, a search that lost to a hedge) becomes
  **suspect**: asked last until its health check answers (probed every
  ``probe_every_s``). The caller fails a call over to the next server in the order.

What a call is (a search on a stream with hedging, a Triton inference) and what the
health check is are the users': :class:`services.index.client.replicas.ReplicaSet`,
:class:`services.encoder.runtime.triton_client.TritonEncoder`. No grpc here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Literal, TypeVar

from services.common import timeouts
from services.common.errors import Unavailable
from services.rpc.discovery import DnsTarget, is_dns_target, parse_dns_target, resolve

if TYPE_CHECKING:
    from services.rpc.tls import ClientTLS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Balancing:
    """How a call picks a server. ``least_outstanding``: the one with the fewest calls in
    flight on it (ties in turn); ``round_robin``: strictly in turn. ``resolve_every_s``:
    how often a DNS-named set is resolved again."""

    mode: Literal["least_outstanding", "round_robin"] = "least_outstanding"
    resolve_every_s: float = 5.0
    resolve_timeout_s: float = 2.0


class Endpoint:
    """One server of a pool: its calls in flight, its misses in a row, whether it is
    suspect. Subclasses own the channel: :meth:`serving` (the health check) and
    :meth:`close`."""

    def __init__(self, address: str, what: str, suspect_after: int, probe_every_s: float) -> None:
        self.address = address
        self.what = what  # for logs: "shard 0 replica 10.0.0.7:50061", "triton 10.0.0.9:8001"
        self.suspect_after = suspect_after
        self.probe_every_s = probe_every_s
        self.misses = 0  # in a row
        self.suspect = False
        self._probe: asyncio.Task[None] | None = None
        self.outstanding = 0  # calls sent to this server and not yet ended
        self._idle = asyncio.Event()
        self._idle.set()

    async def serving(self) -> bool:
        """The server's health check (True: it serves); raising counts as False."""
        raise NotImplementedError

    async def close(self) -> None:
        await timeouts.cancel_and_wait(self._probe)  # a lost cancel kept it probing

    def sent(self) -> None:
        self.outstanding += 1
        self._idle.clear()

    def done(self, _task: object = None) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:
            self._idle.set()

    async def drained(self, timeout: float) -> None:
        """Return once no call waits on this server (or after ``timeout``)."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            pass

    def answered(self, seconds: float) -> None:
        """A call ended well after ``seconds``: the misses in a row start again."""
        self.misses = 0

    def probe(self, why: str) -> None:
        """Ask this server last until its health check says it serves (one that just
        appeared in DNS: it may still be loading)."""
        if not self.suspect:
            self.suspect = True
            log.info("%s: %s; asked last until it serves", self.what, why)
            self._probe = asyncio.ensure_future(self._until_serving())

    def missed(self, why: str) -> None:
        self.misses += 1
        if self.misses >= self.suspect_after and not self.suspect:
            self.suspect = True
            log.warning(
                "%s is suspect (%d misses in a row, last: %s): asked last until its health "
                "check says it serves",
                self.what,
                self.misses,
                why,
            )
            self._probe = asyncio.ensure_future(self._until_serving())

    async def _until_serving(self) -> None:
        while True:
            try:
                if await self.serving():
                    break
            except Exception as exc:  # a failing check is a failed one
                log.debug("%s: health check failed: %r", self.what, exc)
            await asyncio.sleep(self.probe_every_s)
        self.suspect = False
        self.misses = 0
        log.info("%s serves again", self.what)


def reconnect_options(probe_every_s: float) -> list[tuple[str, int]]:
    """The reconnect backoff of a channel to one server of a pool: from 0.1 s up to the
    pool's ``probe_every_s`` (gRPC's default goes 1 s, x1.6, up to 120 s). A channel in
    TRANSIENT_FAILURE fails its calls and the health probe at once until its next attempt,
    so after a ten-second outage the default kept a server that served again out of the
    calls for seconds more (issue #33: 3-4 s of partial answers after both replicas of a
    shard were healthy; tests/integration/test_replica_recovery.py). The cost: a dead
    server gets one connection attempt per ``probe_every_s``. Not set:
    ``grpc.min_reconnect_backoff_ms``, which gRPC core reads as the minimum *connect
    timeout* (20 s by default): at 100 ms a connection to a replica that accepts but never
    answers (SIGSTOPped, overloaded) failed UNAVAILABLE after 0.1 s instead of its search
    waiting for its deadline (``test_index_durability.py``)."""
    most = max(100, int(probe_every_s * 1000))
    return [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", most),
    ]


E = TypeVar("E", bound=Endpoint)


def tls_for(tls: ClientTLS | None, target: DnsTarget | None) -> ClientTLS | None:
    """The TLS of a pool's channels: a DNS-named pool's servers are IP addresses, so
    their certificates are checked against the DNS name (unless ``server_name`` says
    otherwise)."""
    if tls is None or target is None or tls.server_name is not None:
        return tls
    return dataclasses.replace(tls, server_name=target.host)


class EndpointPool(Generic[E]):
    """The servers behind one name (``addresses``: ``host:port`` each, or one
    ``dns:`` target), built by ``make(address)``; :meth:`order` says whom a call asks
    first. ``what`` names the set in errors and logs ("shard 0", "triton")."""

    def __init__(
        self,
        what: str,
        addresses: Sequence[str],
        make: Callable[[str], E],
        balancing: Balancing | None = None,
    ) -> None:
        if not addresses:
            raise ValueError(f"{what} has no address")
        self.what = what
        self.make = make
        self.balancing = balancing or Balancing()
        self.target: DnsTarget | None = None
        self.endpoints: list[E] = []
        if any(is_dns_target(a) for a in addresses):
            if len(addresses) != 1:
                raise ValueError(f"{what}: a dns: target names all its servers alone")
            self.target = parse_dns_target(addresses[0])
        else:
            self.endpoints = [make(a) for a in addresses]
        self._turn = itertools.count()
        self._resolved: asyncio.Event | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._retiring: set[asyncio.Task[None]] = set()

    def known(self) -> list[E] | None:
        """The servers now, when that needs no wait (a fixed list, or a DNS target
        resolved once already); None otherwise: :meth:`current` waits for the first
        resolution. A call's fast path: no timer for what is already known."""
        if self.target is None or (self._resolved is not None and self._resolved.is_set()):
            return self.endpoints
        return None

    async def current(self) -> list[E]:
        """The servers now (a DNS target is resolved on first use, then watched)."""
        if self.target is not None:
            if self._resolved is None:
                self._resolved = asyncio.Event()
                self._watcher = asyncio.ensure_future(self._watch(self.target))
            await self._resolved.wait()
        return self.endpoints

    async def _watch(self, target: DnsTarget) -> None:
        assert self._resolved is not None
        while True:
            try:
                self.update(await resolve(target, self.balancing.resolve_timeout_s))
            except Unavailable as exc:
                log.warning("%s: %s; keeping %d known servers", self.what, exc, len(self.endpoints))
            except Exception:  # the watcher must outlive a surprise: calls wait on it
                log.exception(
                    "%s: resolving %s failed; keeping %d known servers",
                    self.what,
                    target,
                    len(self.endpoints),
                )
            self._resolved.set()
            await asyncio.sleep(self.balancing.resolve_every_s)

    def update(self, addresses: Sequence[str]) -> None:
        """Take ``addresses`` as the servers: new ones are asked last until their health
        check says they serve (except in the first set), gone ones are closed once their
        calls ended. An empty answer keeps the known servers (a headless Service with no
        ready pod: they fail over or time out as they are)."""
        if not addresses:
            if self.endpoints:
                log.warning(
                    "%s: %s resolves to no server; keeping %d known",
                    self.what,
                    self.target,
                    len(self.endpoints),
                )
            return
        known = {e.address: e for e in self.endpoints}
        first = not known
        kept = [known[a] for a in addresses if a in known]
        added = [self.make(a) for a in addresses if a not in known]
        gone = [e for a, e in known.items() if a not in set(addresses)]
        self.endpoints = kept + added
        for endpoint in added:
            if not first:
                endpoint.probe("discovered")
        if added or gone:
            log.info(
                "%s servers: %s (added %s, removed %s)",
                self.what,
                ", ".join(addresses),
                [e.address for e in added],
                [e.address for e in gone],
            )
        for endpoint in gone:
            task = asyncio.ensure_future(self._retire(endpoint))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _retire(self, endpoint: E) -> None:
        try:
            await endpoint.drained(30.0)
        finally:  # also when the pool closes first: the channel is closed either way
            await endpoint.close()

    def order(self, endpoints: list[E]) -> list[E]:
        """Non-suspect servers first, by fewest calls in flight (least_outstanding) or in
        turn (round_robin); ties go in turn; suspect ones last."""
        n = len(endpoints)
        first = next(self._turn) % n
        turn = endpoints[first:] + endpoints[:first]
        if self.balancing.mode == "least_outstanding":
            turn.sort(key=lambda e: e.outstanding)  # stable: ties stay in turn
        return [e for e in turn if not e.suspect] + [e for e in turn if e.suspect]

    async def close(self) -> None:
        await timeouts.cancel_and_wait(self._watcher)  # a loop: a lost cancel kept it
        retiring = list(self._retiring)  # each closes its server as it ends: cancelled once
        for task in retiring:
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        for endpoint in self.endpoints:
            await endpoint.close()
