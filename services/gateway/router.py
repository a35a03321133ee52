"""Fan-out of a search to every index shard, merge of the top-k (implements VectorIndex).

Every shard gets the query batch in parallel with the remaining deadline (minus a small
reserve for the merge and the document fetch). Within a shard the replicas are tried in
round-robin order, failing over on UNAVAILABLE. A shard that does not answer in time, or
whose replicas are all down, is reported in ``missing_shards`` (a partial result) unless
the caller asked for complete results, in which case the search fails with that error.
A shard's INVALID_ARGUMENT (e.g. nprobe above its nlist) fails the search: it is the
caller's mistake, not an outage.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Sequence

import grpc
import numpy as np

from retrieval.v1 import common_pb2, index_pb2, index_pb2_grpc
from services.common.deadline import Deadline
from services.common.errors import DeadlineExceeded, RetrievalError, Unavailable
from services.common.status import error_from_rpc
from services.gateway.domain import Consistency, FieldCondition
from services.gateway.ports import IndexHit, IndexResult
from services.index.convert import vectors_to_pb

log = logging.getLogger(__name__)

_CONSISTENCY_PB = {
    Consistency.EVENTUAL: common_pb2.CONSISTENCY_EVENTUAL,
    Consistency.SESSION: common_pb2.CONSISTENCY_SESSION,
    Consistency.STRONG: common_pb2.CONSISTENCY_STRONG,
}
# Time kept back from the shards for merging, fetching documents and answering.
RESERVE_FRACTION = 0.1
RESERVE_MIN_S = 0.005

OUTAGES = (Unavailable, DeadlineExceeded)


def merge_top_k(per_shard: Sequence[Sequence[IndexHit]], k: int) -> list[IndexHit]:
    """The k best hits over all shards by score (ties: lower shard first, stable)."""
    return heapq.nlargest(k, itertools.chain.from_iterable(per_shard), key=lambda h: h.score)


class _Shard:
    def __init__(self, index: int, addresses: Sequence[str]) -> None:
        self.index = index
        self.addresses = list(addresses)
        self.channels = [grpc.aio.insecure_channel(a) for a in addresses]
        self.stubs = [index_pb2_grpc.IndexShardServiceStub(c) for c in self.channels]
        self._next = itertools.cycle(range(len(addresses)))

    async def search(
        self, request: index_pb2.ShardSearchRequest, deadline: Deadline
    ) -> index_pb2.ShardSearchResponse:
        first = next(self._next)
        error: RetrievalError = Unavailable(f"shard {self.index}: no replica")
        for attempt in range(len(self.stubs)):
            replica = (first + attempt) % len(self.stubs)
            remaining = deadline.remaining()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded(f"shard {self.index}: no time left")
            try:
                response: index_pb2.ShardSearchResponse = await self.stubs[replica].Search(
                    request, timeout=remaining
                )
                return response
            except grpc.aio.AioRpcError as exc:
                error = error_from_rpc(exc, f"shard {self.index} replica {self.addresses[replica]}")
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise error from None
        raise error

    async def stats(self) -> list[index_pb2.ShardStats]:
        return [await stub.Stats(index_pb2.ShardStatsRequest(), timeout=5.0) for stub in self.stubs]

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


class ShardRouter:
    def __init__(self, shards: Sequence[Sequence[str]]) -> None:
        self._shards = [_Shard(i, replicas) for i, replicas in enumerate(shards)]
        self.num_shards = len(self._shards)

    async def search(
        self,
        vectors: np.ndarray,
        k: int,
        *,
        nprobe: int,
        filter: Sequence[FieldCondition],
        consistency: Consistency,
        write_token: dict[int, str],
        timeout: float | None,
        require_complete: bool,
    ) -> IndexResult:
        overall = Deadline.after(timeout)
        remaining = overall.remaining()
        shard_deadline = (
            overall
            if remaining is None
            else Deadline.after(
                max(0.0, remaining - max(RESERVE_MIN_S, remaining * RESERVE_FRACTION))
            )
        )
        queries = vectors_to_pb(vectors)
        pb_filter = common_pb2.Filter(
            must=[common_pb2.FieldCondition(key=c.key, any_of=c.any_of) for c in filter]
        )

        def request(shard: int) -> index_pb2.ShardSearchRequest:
            return index_pb2.ShardSearchRequest(
                shard=shard,
                queries=queries,
                k=k,
                nprobe=nprobe,
                filter=pb_filter,
                consistency=_CONSISTENCY_PB[consistency],
                min_position=write_token.get(shard, "")
                if consistency is Consistency.SESSION
                else "",
            )

        outcomes = await asyncio.gather(
            *[s.search(request(s.index), shard_deadline) for s in self._shards],
            return_exceptions=True,
        )
        per_query: list[list[list[IndexHit]]] = [[] for _ in range(len(vectors))]
        missing: list[int] = []
        for shard, outcome in zip(self._shards, outcomes, strict=True):
            if isinstance(outcome, OUTAGES) and not require_complete:
                log.warning("partial result: %s", outcome)
                missing.append(shard.index)
                continue
            if isinstance(outcome, BaseException):
                raise outcome
            for row, hits in enumerate(outcome.results):
                per_query[row].append(
                    [
                        IndexHit(doc_id, float(score), shard.index)
                        for doc_id, score in zip(hits.ids, hits.scores, strict=True)
                    ]
                )
        return IndexResult([merge_top_k(rows, k) for rows in per_query], missing)

    async def stats(self) -> list[list[index_pb2.ShardStats]]:
        return [await s.stats() for s in self._shards]

    async def close(self) -> None:
        for shard in self._shards:
            await shard.close()
