"""The replicas of one shard as the router sees them: whom to ask, when to hedge, whom
to avoid.

A replica that is down answers UNAVAILABLE at once, and one that is full (its in-flight
limit) RESOURCE_EXHAUSTED: the search fails over to the next one. A replica that hangs
(a stopped process, a long GC or swap pause, a saturated node) answers nothing, and
failing over on errors alone then costs the whole deadline:
measured with one of two replicas SIGSTOPped, half the searches came back partial
(p99 916 ms at a 1 s deadline) while the healthy replica idled. So a search is
**hedged**: when its replica has not answered within that replica's recent p95 (at least
``min_delay_s``; ``unknown_delay_s`` until enough answers were seen; at most half of
what is left of the deadline), the same search goes to the next replica as well and
the first answer wins; the other is cancelled. By construction about one search in
twenty is sent twice on a healthy shard.

A replica that keeps missing (``suspect_after`` searches in a row that it lost to a
hedge, did not answer in time or refused as unavailable) becomes **suspect**: it is
asked last until it answers the gRPC health check as SERVING again (probed in the
background every ``probe_every_s``).

Among the others a search goes to the replica with the fewest searches outstanding
(its own and every other wave's on that replica's stream; ties in turn), or strictly
in turn (:class:`Balancing`). The replicas are a fixed list, or the addresses a DNS
name resolves to (:mod:`services.index.client.discovery`; the chart's headless Service
of the shard), resolved again every ``resolve_every_s``: a replica that appears is
asked last until its health check answers SERVING, one that disappears gets no new
search and is closed once its searches are answered.

Each replica is reached over one long-lived ``SearchStream``: searches travel as tagged
messages on it.

A unary gRPC call costs ~3× a stream message in Python (call set-up, headers, the
per-call task on both sides: 290 vs 100 µs of server CPU, 200 vs 95 µs of client CPU,
measured here with 23 KB requests), and the router sends one call per shard per wave.
So the router keeps one stream per replica, opened on first use, and matches answers
to searches by tag:

* a search waits at most its remaining deadline (then DeadlineExceeded; the replica's
  late answer is dropped) and carries that budget in ``timeout_us``;
* a search's own error comes back in its answer and is raised as the same domain error
  (a shard's INVALID_ARGUMENT stays one), the stream stays open;
* if the stream breaks (the replica died, the connection dropped), every search waiting
  on it fails with Unavailable, so the router fails over to the next replica, and the
  next search opens a new stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from retrieval.v1 import index_pb2, index_pb2_grpc
from services.common.deadline import Deadline
from services.common.errors import DeadlineExceeded, Overloaded, RetrievalError, Unavailable
from services.common.status import error_from_rpc, error_from_status
from services.common.tls import ClientTLS, aio_channel
from services.index import convert
from services.index.client.discovery import DnsTarget, is_dns_target, parse_dns_target, resolve
from services.index.core.query import ShardAnswer

log = logging.getLogger(__name__)


# --- one replica's search stream -----------------------------------------------


class _Open:
    """One open stream: its call, the searches waiting on it, the tasks that write the
    outgoing messages (one at a time, in order) and read the answers.

    Searches never write to the call themselves: a search is cancelled when it loses to
    a hedge or runs out of time, and a write cancelled half-way leaves the call unusable
    ("RPC already finished" for every later search on it). They queue their message
    instead; the writer skips the messages of searches that are no longer waiting.
    """

    def __init__(self, stub: index_pb2_grpc.IndexShardServiceStub, name: str) -> None:
        self.name = name
        self.call = stub.SearchStream()
        self.waiting: dict[int, asyncio.Future[index_pb2.ShardStreamResponse]] = {}
        self.outbox: asyncio.Queue[index_pb2.ShardStreamRequest] = asyncio.Queue()
        self.broken: RetrievalError | None = None
        self.reader = asyncio.ensure_future(self._read())
        self.writer = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        try:
            while True:
                message = await self.outbox.get()
                if message.tag in self.waiting:
                    await self.call.write(message)
        except asyncio.CancelledError:
            pass
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError) as exc:
            self._break(Unavailable(f"{self.name}: writing to the search stream failed: {exc}"))
            self.call.cancel()

    async def _read(self) -> None:
        error: RetrievalError = Unavailable(f"{self.name}: search stream ended")
        try:
            while True:
                reply = await self.call.read()
                if reply is grpc.aio.EOF:
                    break
                future = self.waiting.pop(reply.tag, None)
                if future is not None and not future.done():
                    future.set_result(reply)
        except grpc.aio.AioRpcError as exc:
            error = error_from_rpc(exc, self.name)
            if not isinstance(error, Unavailable):  # the stream is gone either way
                error = Unavailable(str(error))
        except asyncio.CancelledError:
            error = Unavailable(f"{self.name}: search stream closed")
        finally:
            self._break(error)
            self.writer.cancel()

    def _break(self, error: RetrievalError) -> None:
        if self.broken is None:
            self.broken = error
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(self.broken)
        self.waiting.clear()

    def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        self.writer.cancel()


class ShardStream:
    """``await ShardStream(stub, name).search(request, deadline)`` → ShardSearchResponse."""

    def __init__(self, stub: index_pb2_grpc.IndexShardServiceStub, name: str) -> None:
        self._stub = stub
        self.name = name
        self._open: _Open | None = None
        self._tags = itertools.count(1)

    def _stream(self) -> _Open:
        if self._open is None or self._open.broken is not None:
            self._open = _Open(self._stub, self.name)
        return self._open

    async def search(
        self, request: index_pb2.ShardSearchRequest, deadline: Deadline
    ) -> index_pb2.ShardSearchResponse:
        stream = self._stream()
        tag = next(self._tags)
        future: asyncio.Future[index_pb2.ShardStreamResponse] = (
            asyncio.get_running_loop().create_future()
        )
        remaining = deadline.remaining()
        stream.waiting[tag] = future
        stream.outbox.put_nowait(
            index_pb2.ShardStreamRequest(
                tag=tag,
                search=request,
                timeout_us=0 if remaining is None else max(1, int(remaining * 1e6)),
            )
        )
        try:
            async with asyncio.timeout(remaining):
                reply = await future
        except TimeoutError:
            raise DeadlineExceeded(f"{self.name}: no answer within the deadline") from None
        finally:
            stream.waiting.pop(tag, None)
        if reply.status_code:
            raise error_from_status(reply.status_code, reply.status_message, self.name)
        return reply.result

    def close(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None


# --- hedging and suspicion ----------------------------------------------------


P95_EVERY = 8  # answers between two recomputations of a replica's p95


@dataclass(frozen=True)
class HedgePolicy:
    enabled: bool = True
    min_delay_s: float = 0.005
    unknown_delay_s: float = 0.05  # before min_samples answers were seen
    min_samples: int = 16
    window: int = 128  # answers kept per replica for its p95
    suspect_after: int = 3
    probe_every_s: float = 0.5


@dataclass(frozen=True)
class Balancing:
    """How a search picks a shard's replica. ``least_outstanding``: the one with the
    fewest searches in flight on it (ties in turn); ``round_robin``: strictly in turn.
    ``resolve_every_s``: how often a DNS-named shard is resolved again."""

    mode: Literal["least_outstanding", "round_robin"] = "least_outstanding"
    resolve_every_s: float = 5.0
    resolve_timeout_s: float = 2.0


class Replica:
    """One replica: its channel, its search stream, its recent latencies and health."""

    def __init__(
        self, shard: int, address: str, policy: HedgePolicy, tls: ClientTLS | None = None
    ) -> None:
        self.shard = shard
        self.address = address
        self.policy = policy
        self.channel = aio_channel(address, tls)
        self.stub = index_pb2_grpc.IndexShardServiceStub(self.channel)
        self.stream = ShardStream(self.stub, f"shard {shard} replica {address}")
        self._latencies: deque[float] = deque(maxlen=policy.window)
        self._answers = 0
        self._p95: float | None = None  # the hedge delay, once min_samples answers were seen
        self.misses = 0  # in a row
        self.suspect = False
        self._probe: asyncio.Task[None] | None = None
        self.outstanding = 0  # searches sent to this replica and not yet answered
        self._idle = asyncio.Event()
        self._idle.set()

    def sent(self) -> None:
        self.outstanding += 1
        self._idle.clear()

    def done(self, _task: object = None) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:
            self._idle.set()

    async def drained(self, timeout: float) -> None:
        """Return once no search waits on this replica (or after ``timeout``)."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            pass

    def probe(self, why: str) -> None:
        """Ask this replica last until its health check answers SERVING (a replica that
        just appeared in DNS: it may still be loading)."""
        if not self.suspect:
            self.suspect = True
            log.info("shard %d replica %s: %s; asked last until SERVING", self.shard,
                     self.address, why)  # fmt: skip
            self._probe = asyncio.ensure_future(self._until_serving())

    def hedge_delay(self, remaining: float | None) -> float:
        delay = self._p95 if self._p95 is not None else self.policy.unknown_delay_s
        return delay if remaining is None else min(delay, remaining / 2)

    def answered(self, seconds: float) -> None:
        """Record an answer's latency; the p95 is recomputed every ``P95_EVERY`` answers
        (once per wave would put a percentile of the window on every search's path)."""
        self._latencies.append(seconds)
        self.misses = 0
        self._answers += 1
        if len(self._latencies) >= self.policy.min_samples and self._answers % P95_EVERY == 0:
            self._p95 = max(self.policy.min_delay_s, float(np.percentile(self._latencies, 95)))

    def missed(self, why: str) -> None:
        self.misses += 1
        if self.misses >= self.policy.suspect_after and not self.suspect:
            self.suspect = True
            log.warning(
                "shard %d replica %s is suspect (%d misses in a row, last: %s): asked last "
                "until its health check answers SERVING",
                self.shard, self.address, self.misses, why,
            )  # fmt: skip
            self._probe = asyncio.ensure_future(self._until_serving())

    async def _until_serving(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        timeout = max(self.policy.probe_every_s, 0.1)
        while True:
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(self.policy.probe_every_s)
        self.suspect = False
        self.misses = 0
        log.info("shard %d replica %s serves again", self.shard, self.address)

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        self.stream.close()
        await self.channel.close()


class ReplicaSet:
    """``await ReplicaSet(shard, addresses).search(request, deadline)`` → ShardAnswer.

    ``addresses``: the replicas' ``host:port``, or one DNS target (``dns:///name:port``)
    whose addresses are the replicas, resolved on first use and every
    ``balancing.resolve_every_s`` after.
    """

    def __init__(
        self,
        shard: int,
        addresses: Sequence[str],
        policy: HedgePolicy | None = None,
        tls: ClientTLS | None = None,
        *,
        balancing: Balancing | None = None,
    ) -> None:
        if not addresses:
            raise ValueError(f"shard {shard} has no replica address")
        self.shard = shard
        self.policy = policy or HedgePolicy()
        self.tls = tls
        self.balancing = balancing or Balancing()
        self.target: DnsTarget | None = None
        if any(is_dns_target(a) for a in addresses):
            if len(addresses) != 1:
                raise ValueError(f"shard {shard}: a dns: target names all its replicas alone")
            self.target = parse_dns_target(addresses[0])
            self.replicas: list[Replica] = []
            if tls is not None and tls.server_name is None:
                # the replicas are IP addresses: their certificates name the DNS name
                self.tls = dataclasses.replace(tls, server_name=self.target.host)
        else:
            self.replicas = [Replica(shard, a, self.policy, tls) for a in addresses]
        self._turn = itertools.count()
        self._resolved: asyncio.Event | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        self.hedged = 0  # searches sent to a second replica because the first was slow

    # --- which replicas there are ----------------------------------------------------

    async def current(self) -> list[Replica]:
        """The replicas now (a DNS target is resolved on first use, then watched)."""
        if self.target is not None:
            if self._resolved is None:
                self._resolved = asyncio.Event()
                self._watcher = asyncio.ensure_future(self._watch(self.target))
            await self._resolved.wait()
        return self.replicas

    async def _watch(self, target: DnsTarget) -> None:
        assert self._resolved is not None
        while True:
            try:
                self.update(await resolve(target, self.balancing.resolve_timeout_s))
            except Unavailable as exc:
                log.warning("shard %d: %s; keeping %d known replicas", self.shard, exc,
                            len(self.replicas))  # fmt: skip
            except Exception:  # the watcher must outlive a surprise: searches wait on it
                log.exception("shard %d: resolving %s failed; keeping %d known replicas",
                              self.shard, target, len(self.replicas))  # fmt: skip
            self._resolved.set()
            await asyncio.sleep(self.balancing.resolve_every_s)

    def update(self, addresses: Sequence[str]) -> None:
        """Take ``addresses`` as the replicas: new ones are asked last until their health
        check answers SERVING (except in the first set), gone ones are closed once their
        searches are answered. An empty answer keeps the known replicas (a headless
        Service with no ready pod: they fail over or time out as they are)."""
        if not addresses:
            if self.replicas:
                log.warning("shard %d: %s resolves to no replica; keeping %d known",
                            self.shard, self.target, len(self.replicas))  # fmt: skip
            return
        known = {r.address: r for r in self.replicas}
        first = not known
        kept = [known[a] for a in addresses if a in known]
        added = [Replica(self.shard, a, self.policy, self.tls) for a in addresses if a not in known]
        gone = [r for a, r in known.items() if a not in set(addresses)]
        self.replicas = kept + added
        for replica in added:
            if not first:
                replica.probe("discovered")
        if added or gone:
            log.info("shard %d replicas: %s (added %s, removed %s)", self.shard,
                     ", ".join(addresses), [r.address for r in added],
                     [r.address for r in gone])  # fmt: skip
        for replica in gone:
            task = asyncio.ensure_future(self._retire(replica))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _retire(self, replica: Replica) -> None:
        try:
            await replica.drained(30.0)
        finally:  # also when the set closes first: the channel is closed either way
            await replica.close()

    def _order(self, replicas: list[Replica]) -> list[Replica]:
        """Non-suspect replicas first, by fewest searches in flight (least_outstanding)
        or in turn (round_robin); ties go in turn; suspect ones last."""
        n = len(replicas)
        first = next(self._turn) % n
        turn = replicas[first:] + replicas[:first]
        if self.balancing.mode == "least_outstanding":
            turn.sort(key=lambda r: r.outstanding)  # stable: ties stay in turn
        return [r for r in turn if not r.suspect] + [r for r in turn if r.suspect]

    # --- one search ----------------------------------------------------------------

    async def search(
        self, request: index_pb2.ShardSearchRequest, deadline: Deadline
    ) -> ShardAnswer:
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(f"shard {self.shard}: no time left")
        try:  # the first resolution of a DNS target waits within the search's deadline
            async with asyncio.timeout(remaining):
                replicas = await self.current()
        except TimeoutError:
            msg = f"shard {self.shard}: {self.target} not resolved in time"
            raise DeadlineExceeded(msg) from None
        if not replicas:
            raise Unavailable(f"shard {self.shard}: {self.target} names no replica")
        order = self._order(replicas)
        running: dict[asyncio.Future[index_pb2.ShardSearchResponse], tuple[Replica, float]] = {}
        error: RetrievalError = Unavailable(f"shard {self.shard}: no replica")

        def ask(replica: Replica) -> None:
            task = asyncio.ensure_future(replica.stream.search(request, deadline))
            replica.sent()
            task.add_done_callback(replica.done)
            running[task] = (replica, time.monotonic())

        waiting = list(order)
        ask(waiting.pop(0))
        try:
            while running:
                hedge = self.policy.enabled and bool(waiting)
                remaining = deadline.remaining()
                timeout = None
                if hedge:
                    slowest = next(iter(running.values()))[0]
                    timeout = slowest.hedge_delay(remaining)
                done, _ = await asyncio.wait(
                    running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:  # the replica is slower than its p95: ask the next one too
                    self.hedged += 1
                    ask(waiting.pop(0))
                    continue
                for task in done:
                    replica, started = running.pop(task)
                    exc = task.exception()
                    if exc is None:
                        replica.answered(time.monotonic() - started)
                        for other, _ in running.values():
                            other.missed("lost to a hedge")
                        return convert.answer_from_pb(task.result())
                    if isinstance(exc, Overloaded):  # full: another replica may not be
                        error = exc
                        if waiting:
                            ask(waiting.pop(0))
                        continue
                    if not isinstance(exc, Unavailable | DeadlineExceeded):
                        raise exc  # the request's own error (e.g. INVALID_ARGUMENT)
                    replica.missed(str(exc))
                    error = exc
                    if isinstance(exc, Unavailable) and waiting:
                        ask(waiting.pop(0))  # fail over at once
            raise error
        finally:
            for task in running:
                task.cancel()

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        retiring = list(self._retiring)
        for task in retiring:
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        for replica in self.replicas:
            await replica.close()
