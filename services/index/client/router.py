"""Fan-out of a search to every index shard and merge of the top-k (used by the gateway).

Every shard gets the whole query batch in parallel with the remaining deadline (minus a
small reserve for the merge and what the caller does next). Within a shard a search goes
to the replica with the fewest searches in flight (a fixed list, or the addresses of a
``dns:///name:port`` target, resolved again every few seconds), failing over to the next
one on UNAVAILABLE and hedging to it when the first is slower than its recent p95
(:mod:`services.index.client.replicas`). A shard that
does not answer in time, or whose replicas are all down, is reported in
``missing_shards`` (a partial result) unless the caller asked for complete results, in
which case the search fails with that shard's error (Unavailable or DeadlineExceeded).
When no shard at all answered, the search fails (DeadlineExceeded or Unavailable): an
OK with zero hits from zero shards would tell the caller that nothing matched. A
shard's INVALID_ARGUMENT fails the search: it is the caller's mistake, not an outage.

Coalescing (:mod:`services.index.client.coalescer`): concurrent single-vector,
unfiltered EVENTUAL/STRONG searches are sent to the shards together, in waves. This cuts
the RPCs per query by the batch size, and the shards run the batch as one FAISS call.
SESSION and filtered searches are never coalesced (their waits and selectors are their
own).

Sparse and hybrid searches (``texts`` and ``sparse_k``, issue #26) go the same way: each
shard answers its dense and its BM25 list of the same batch in one message, the router
merges each list over the shards (:func:`~services.index.client.merge.merge_answers`;
BM25 scores are each shard's, as in Elasticsearch's query-then-fetch) and leaves the
fusion to the caller. A shard
that answers without a sparse list (no text index) is in ``sparse_missing_shards``.
Waves hold one kind of search (dense, sparse or both).

The merge (:mod:`services.index.client.merge`) is pure and unit-tested; only this module
touches grpc.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

import grpc
import numpy as np

from retrieval.v1 import index_pb2, index_pb2_grpc
from services.common.deadline import Deadline
from services.common.domain import IndexResult
from services.common.errors import FailedPrecondition, InvalidArgument, RetrievalError
from services.common.limits import MAX_K
from services.index import convert
from services.index.client.coalescer import Coalescer
from services.index.client.merge import merge_answers, shard_deadline
from services.index.client.replicas import HedgePolicy, Replica, ReplicaSet
from services.index.core.coarse import CoarseQuantizer
from services.index.core.query import Consistency, IndexQuery, Probes, ShardAnswer
from services.rpc.balance import Balancing
from services.rpc.tls import ClientTLS
from services.telemetry import tracing

log = logging.getLogger(__name__)

QUANTIZER_RETRY_S = 30.0  # after a failed fetch of the shared quantizer


class _Shard:
    """The replicas of one shard (:class:`ReplicaSet`: balancing, failover, hedging),
    and the calls that any one replica answers for the shard."""

    def __init__(
        self,
        index: int,
        addresses: Sequence[str],
        policy: HedgePolicy,
        tls: ClientTLS | None = None,
        balancing: Balancing | None = None,
    ) -> None:
        self.index = index
        self.replicas = ReplicaSet(index, addresses, policy, tls, balancing=balancing)

    async def search(
        self, request: index_pb2.ShardSearchRequest, deadline: Deadline
    ) -> ShardAnswer:
        return await self.replicas.search(request, deadline)

    async def quantizer(self) -> CoarseQuantizer | None:
        """The trained quantizer from whichever replica gives it first (None if none).

        Every replica is asked at once: asked one after the other, a hung replica first
        in the list held the first search of a new router for the call's 5 s timeout."""

        async def one(replica: Replica) -> CoarseQuantizer:
            try:
                reply = await replica.stub.Quantizer(index_pb2.QuantizerRequest(), timeout=5.0)
                return convert.quantizer_from_pb(reply)
            except (grpc.aio.AioRpcError, RetrievalError) as exc:
                log.warning(
                    "no quantizer from shard %d replica %s: %s", self.index, replica.address, exc
                )
                raise

        tasks = [asyncio.ensure_future(one(r)) for r in await self.replicas.current()]
        try:
            for answer in asyncio.as_completed(tasks):
                try:
                    return await answer
                except (grpc.aio.AioRpcError, RetrievalError):
                    continue
            return None
        finally:
            for task in tasks:
                task.cancel()

    async def stats(self) -> list[index_pb2.ShardStats | None]:
        async def one(stub: index_pb2_grpc.IndexShardServiceStub) -> index_pb2.ShardStats | None:
            try:
                reply: index_pb2.ShardStats = await stub.Stats(
                    index_pb2.ShardStatsRequest(), timeout=5.0
                )
                return reply
            except grpc.aio.AioRpcError:
                return None

        replicas = await self.replicas.current()
        return list(await asyncio.gather(*[one(r.stub) for r in replicas]))

    async def close(self) -> None:
        await self.replicas.close()


class ShardRouter:
    """``ShardRouter([["host:port", ...replicas of shard 0], [...shard 1], ...])``.

    ``coalesce=True`` (default) batches concurrent single-query searches (see above);
    ``max_waves`` fan-outs may be in flight at once. ``share_quantizer=True`` (default)
    assigns each batch to its inverted lists once, here, instead of once per shard
    (:mod:`services.index.core.coarse`). ``hedge`` says when a slow replica's search is also
    sent to another one (:class:`HedgePolicy`; ``HedgePolicy(enabled=False)``: never).
    ``balancing`` picks a shard's replica (:class:`Balancing`: least outstanding
    searches by default; how often a ``dns:`` target is resolved again).
    """

    def __init__(
        self,
        shards: Sequence[Sequence[str]],
        *,
        coalesce: bool = True,
        max_waves: int = 2,
        share_quantizer: bool = True,
        hedge: HedgePolicy | None = None,
        tls: ClientTLS | None = None,
        balancing: Balancing | None = None,
    ) -> None:
        if not shards:
            raise ValueError("at least one shard is needed")
        policy = hedge or HedgePolicy()
        self._shards = [
            _Shard(i, replicas, policy, tls, balancing) for i, replicas in enumerate(shards)
        ]
        self.num_shards = len(self._shards)
        self._coalescer = Coalescer(self, max_waves) if coalesce else None
        self._share_quantizer = share_quantizer
        self._quantizer: CoarseQuantizer | None = None
        self._quantizer_retry_at = 0.0

    async def search(self, query: IndexQuery, timeout: float | None = None) -> IndexResult:
        """Top-k per query vector over all shards, best first (and the BM25 lists that
        ``query`` asks for in ``IndexResult.sparse``: :class:`IndexQuery`). ``timeout`` in
        seconds (None = none)."""
        vectors, k, texts, sparse_k = query.vectors, query.k, query.texts, query.sparse_k
        if vectors is not None:
            vectors = np.ascontiguousarray(vectors, dtype=np.float32)
            if vectors.ndim != 2 or len(vectors) == 0:
                raise InvalidArgument(f"queries: expected a (n, dim) matrix, got {vectors.shape}")
            if not 1 <= k <= MAX_K:
                raise InvalidArgument(f"k: {k} is out of range 1..{MAX_K}")
            if vectors is not query.vectors:  # a copy was made (another dtype or layout)
                query = dataclasses.replace(query, vectors=vectors)
        elif k or not sparse_k:
            raise InvalidArgument("a search needs query vectors, or texts and sparse_k only")
        if sparse_k or texts:
            if not 1 <= sparse_k <= MAX_K:
                raise InvalidArgument(f"sparse_k: {sparse_k} is out of range 1..{MAX_K}")
            if not texts or (vectors is not None and len(texts) != len(vectors)):
                raise InvalidArgument("texts: one query text per query vector")
        if query.write_token:
            unknown = [s for s in query.write_token if not 0 <= s < self.num_shards]
            if unknown:
                raise InvalidArgument(f"write_token: unknown shards {unknown}")
        if (
            self._coalescer is not None
            and query.rows == 1
            and not query.filter
            and query.consistency is not Consistency.SESSION
        ):
            return await self._coalescer.search(query, timeout)
        return await self.fan_out(query, timeout)

    async def fan_out(self, query: IndexQuery, timeout: float | None) -> IndexResult:
        """One ShardSearchRequest per shard for the whole batch; merge the answers."""
        tasks = await self.launch(query, shard_deadline(Deadline.after(timeout)))
        try:
            answers = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
        dense_k = query.k if query.vectors is not None else 0
        return merge_answers(answers, query.rows, dense_k, query.sparse_k, query.require_complete)

    async def launch(
        self, query: IndexQuery, deadline: Deadline
    ) -> list[asyncio.Task[ShardAnswer]]:
        """Send one ShardSearchRequest per shard for the whole batch: the tasks of their
        answers, in shard order (the caller merges what it waits for).

        With the shared quantizer, the batch is assigned here; should a shard have other
        centroids (FailedPrecondition: the index was retrained), the router forgets its
        copy and sends that shard the batch again for it to assign itself (the shards
        that took the probes have the router's centroids: their answers stand).
        """
        probes: Probes | None = None
        if query.vectors is not None:
            quantizer = await self._coarse(query.vectors)
            if quantizer is not None:
                probes = quantizer.assign(query.vectors, query.nprobe)

        def request(shard: int, probes: Probes | None) -> index_pb2.ShardSearchRequest:
            return convert.query_to_pb(query.shard_query(shard, probes))

        async def one(shard: _Shard) -> ShardAnswer:
            with tracing.span("shard search", tracing.CLIENT) as span:
                if span:
                    span.set_attributes(
                        {
                            "gtr.shard": shard.index,
                            "gtr.queries": query.rows,
                            "gtr.dense_k": query.k if query.vectors is not None else 0,
                            "gtr.sparse_k": query.sparse_k,
                        }
                    )
                return await ask(shard)

        async def ask(shard: _Shard) -> ShardAnswer:
            if probes is not None:
                try:
                    return await shard.search(request(shard.index, probes), deadline)
                except FailedPrecondition:
                    log.warning(
                        "shard %d refused this router's quantizer: fetching it again later",
                        shard.index,
                    )
                    self._quantizer = None
            return await shard.search(request(shard.index, None), deadline)

        return [asyncio.ensure_future(one(s)) for s in self._shards]

    async def _coarse(self, vectors: np.ndarray) -> CoarseQuantizer | None:
        """The shared quantizer when it applies to ``vectors`` (fetched on first use)."""
        if not self._share_quantizer:
            return None
        if self._quantizer is None and time.monotonic() >= self._quantizer_retry_at:
            self._quantizer_retry_at = time.monotonic() + QUANTIZER_RETRY_S
            self._quantizer = await self._shards[0].quantizer()
        q = self._quantizer
        if q is None or vectors.shape[1] != q.dim:
            return None  # a wrong dimension: the shards report it (FAISS would assert)
        return q

    async def stats(self) -> list[list[index_pb2.ShardStats | None]]:
        """Stats of every replica of every shard (None for a replica that did not answer)."""
        return list(await asyncio.gather(*[s.stats() for s in self._shards]))

    async def close(self) -> None:
        for shard in self._shards:
            await shard.close()
