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
in turn (:class:`~services.rpc.balance.Balancing`). The replicas are a fixed list,
or the addresses a DNS name resolves to (the chart's headless Service of the shard),
resolved again every ``resolve_every_s``: a replica that appears is asked last until
its health check answers SERVING, one that disappears gets no new search and is closed
once its searches are answered. Which replicas there are, their order and suspicion
are :mod:`services.rpc.balance`'s, shared with the gateway's Triton client; what a
search is (a tagged message on a stream, hedged) is this module's.

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
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from retrieval.v1 import index_pb2, index_pb2_grpc
from services.common.deadline import Deadline
from services.common.errors import DeadlineExceeded, Overloaded, RetrievalError, Unavailable
from services.index import convert
from services.index.core.query import ShardAnswer
from services.rpc.balance import Balancing, Endpoint, EndpointPool, reconnect_options, tls_for
from services.rpc.discovery import DnsTarget
from services.rpc.status import error_from_rpc, error_from_status
from services.rpc.tls import ClientTLS, Rotating, aio_channel
from services.telemetry import tracing

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
        message = index_pb2.ShardStreamRequest(
            tag=tag,
            search=request,
            timeout_us=0 if remaining is None else max(1, int(remaining * 1e6)),
        )
        if tracing.enabled():  # the search's own context: a stream has no per-search metadata
            message.traceparent, message.tracestate = tracing.traceparent()
        stream.outbox.put_nowait(message)
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


@dataclass
class _Connection:
    channel: grpc.aio.Channel
    stub: index_pb2_grpc.IndexShardServiceStub
    stream: ShardStream

    async def close(self) -> None:
        self.stream.close()
        await self.channel.close()


class Replica(Endpoint):
    """One replica: its channel, its search stream, its recent latencies and health.

    The channel is rebuilt when the TLS files change on disk (:class:`Rotating`): new
    searches go over a new channel and stream; the old ones are closed once the
    searches on them were answered."""

    def __init__(
        self, shard: int, address: str, policy: HedgePolicy, tls: ClientTLS | None = None
    ) -> None:
        super().__init__(
            address, f"shard {shard} replica {address}", policy.suspect_after, policy.probe_every_s
        )
        self.shard = shard
        self.policy = policy
        self.tls = tls
        self.connections = Rotating(self._connect, _Connection.close, tls, self.what)
        self._latencies: deque[float] = deque(maxlen=policy.window)
        self._answers = 0
        self._p95: float | None = None  # the hedge delay, once min_samples answers were seen

    def _connect(self) -> _Connection:
        channel = aio_channel(self.address, self.tls, reconnect_options(self.policy.probe_every_s))
        stub = index_pb2_grpc.IndexShardServiceStub(channel)
        return _Connection(channel, stub, ShardStream(stub, self.what))

    @property
    def channel(self) -> grpc.aio.Channel:
        return self.connections.current.channel

    @property
    def stub(self) -> index_pb2_grpc.IndexShardServiceStub:
        return self.connections.current.stub

    async def search(
        self, request: index_pb2.ShardSearchRequest, deadline: Deadline
    ) -> index_pb2.ShardSearchResponse:
        with self.connections.use() as connection:
            return await connection.stream.search(request, deadline)

    def hedge_delay(self, remaining: float | None) -> float:
        delay = self._p95 if self._p95 is not None else self.policy.unknown_delay_s
        return delay if remaining is None else min(delay, remaining / 2)

    def answered(self, seconds: float) -> None:
        """Record an answer's latency; the p95 is recomputed every ``P95_EVERY`` answers
        (once per wave would put a percentile of the window on every search's path)."""
        super().answered(seconds)
        self._latencies.append(seconds)
        self._answers += 1
        if len(self._latencies) >= self.policy.min_samples and self._answers % P95_EVERY == 0:
            self._p95 = max(self.policy.min_delay_s, float(np.percentile(self._latencies, 95)))

    async def serving(self) -> bool:
        health = health_pb2_grpc.HealthStub(self.channel)
        reply = await health.Check(
            health_pb2.HealthCheckRequest(), timeout=max(self.policy.probe_every_s, 0.1)
        )
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        await super().close()
        await self.connections.close()


class ReplicaSet:
    """``await ReplicaSet(shard, addresses).search(request, deadline)`` → ShardAnswer.

    ``addresses``: the replicas' ``host:port``, or one DNS target (``dns:///name:port``)
    whose addresses are the replicas, resolved on first use and every
    ``balancing.resolve_every_s`` after (:class:`~services.rpc.balance.EndpointPool`).
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
        self.pool: EndpointPool[Replica] = EndpointPool(
            f"shard {shard}",
            addresses,
            lambda address: Replica(shard, address, self.policy, self.tls),
            balancing,
        )
        self.tls = tls_for(tls, self.pool.target)
        self.hedged = 0  # searches sent to a second replica because the first was slow

    # --- which replicas there are ----------------------------------------------------

    @property
    def replicas(self) -> list[Replica]:
        return self.pool.endpoints

    @property
    def target(self) -> DnsTarget | None:
        return self.pool.target

    async def current(self) -> list[Replica]:
        """The replicas now (a DNS target is resolved on first use, then watched)."""
        return await self.pool.current()

    def update(self, addresses: Sequence[str]) -> None:
        """Take ``addresses`` as the replicas (:meth:`EndpointPool.update`)."""
        self.pool.update(addresses)

    # --- one search ----------------------------------------------------------------

    async def search(
        self, request: index_pb2.ShardSearchRequest, deadline: Deadline
    ) -> ShardAnswer:
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(f"shard {self.shard}: no time left")
        replicas = self.pool.known()
        if replicas is None:  # a DNS target's first resolution, within the deadline
            try:
                async with asyncio.timeout(remaining):
                    replicas = await self.current()
            except TimeoutError:
                msg = f"shard {self.shard}: {self.target} not resolved in time"
                raise DeadlineExceeded(msg) from None
        if not replicas:
            raise Unavailable(f"shard {self.shard}: {self.target} names no replica")
        order = self.pool.order(replicas)
        running: dict[asyncio.Future[index_pb2.ShardSearchResponse], tuple[Replica, float]] = {}
        error: RetrievalError = Unavailable(f"shard {self.shard}: no replica")

        def ask(replica: Replica) -> None:
            task = asyncio.ensure_future(replica.search(request, deadline))
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
        await self.pool.close()
