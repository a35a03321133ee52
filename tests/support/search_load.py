"""Search load on a router and what the replicas counted of it, for the replica tests and
``bench.replicas``: concurrent searches through a :class:`ShardRouter` (errors returned,
not raised, in query order), whether one missed a shard, and each replica's own count of
the queries it answered (``ShardStats.searches``: the replica counts, not the router).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import grpc
import numpy as np

from retrieval.v1 import index_pb2, index_pb2_grpc
from services.common.domain import IndexResult
from services.index.client.router import ShardRouter
from services.index.core.query import IndexQuery
from tests.support.shards import ShardProcess

SearchOutcome = IndexResult | BaseException


async def search_load(
    router: ShardRouter,
    queries: np.ndarray,
    concurrency: int,
    on_done: Callable[[int], None] | None = None,
) -> list[SearchOutcome]:
    """One top-10 search (5 s deadline) per query row, ``concurrency`` at a time; results
    (or the exception raised) in query order. ``on_done(n)`` after the n-th finished."""
    gate = asyncio.Semaphore(concurrency)
    done = 0

    async def one(row: np.ndarray) -> SearchOutcome:
        nonlocal done
        async with gate:
            try:
                return await router.search(IndexQuery(row[None, :], 10), timeout=5.0)
            except Exception as exc:
                return exc
            finally:
                done += 1
                if on_done is not None:
                    on_done(done)

    return list(await asyncio.gather(*[one(q) for q in queries]))


def missed(outcome: SearchOutcome) -> bool:
    """The search failed, or came back without some shard."""
    return isinstance(outcome, BaseException) or bool(outcome.missing_shards)


def shard_stats(proc: ShardProcess) -> index_pb2.ShardStats:
    """The replica's own Stats (sizes, positions, searches answered)."""
    with grpc.insecure_channel(proc.address) as channel:
        reply: index_pb2.ShardStats = index_pb2_grpc.IndexShardServiceStub(channel).Stats(
            index_pb2.ShardStatsRequest(), timeout=10
        )
        return reply


def searches_answered(procs: Iterable[ShardProcess]) -> dict[str, int]:
    """Queries answered so far, per replica address, as each replica counts them."""
    return {proc.address: int(shard_stats(proc).searches) for proc in procs}
