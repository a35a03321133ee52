"""The builder asks a generation's shard replicas what they have applied and how big they
are (the Stats RPC): the switch waits for the target's replicas to reach the target's log
tails, and ``index generations`` shows sizes and drift. Addresses are the gateway's
``--shards`` syntax (``{gtr}:addrs``); a ``dns:`` target reaches one replica of its
shard (whichever gRPC picks)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.errors import RetrievalError
from services.index.client.addresses import parse_shard_addresses
from services.rpc.status import error_from_rpc
from services.rpc.tls import ClientTLS, aio_channel


@dataclass(frozen=True)
class ReplicaStats:
    address: str
    shard: int
    applied: str
    vectors: int
    memory_bytes: int
    pq_error_ratio: float
    gpu: bool = False  # it searches from a GPU copy of its index


def parse_addresses(spec: str) -> list[list[str]]:
    """ "a:1,a:2;b:1" → [["a:1", "a:2"], ["b:1"]] (the gateway's --shards syntax)."""
    return parse_shard_addresses(spec)


async def replica_stats(
    address: str, tls: ClientTLS | None = None, timeout: float = 5.0, applied_at_least: str = ""
) -> ReplicaStats:
    """One replica's Stats; Unavailable (or the mapped error) when it does not answer.
    ``applied_at_least``: once it has applied that log position (DeadlineExceeded when
    ``timeout`` comes first)."""
    import grpc

    from retrieval.v1 import index_pb2, index_pb2_grpc

    async with aio_channel(address, tls) as channel:
        try:
            reply = await index_pb2_grpc.IndexShardServiceStub(channel).Stats(
                index_pb2.ShardStatsRequest(applied_at_least=applied_at_least), timeout=timeout
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, f"shard replica {address}") from exc
    return ReplicaStats(
        address,
        reply.shard,
        reply.applied_position or "0-0",
        reply.vectors,
        reply.memory_bytes,
        reply.pq_error_ratio,
        reply.gpu,
    )


async def all_stats(
    spec: str,
    tls: ClientTLS | None = None,
    timeout: float = 5.0,
    applied_at_least: Sequence[str] = (),
) -> list[list[ReplicaStats | RetrievalError]]:
    """Per shard, per replica of ``spec``: its Stats, or the error asking gave;
    ``applied_at_least`` (per shard, by index): each replica's once it has applied its
    shard's position (:func:`replica_stats`)."""

    async def one(address: str, at_least: str) -> ReplicaStats | RetrievalError:
        try:
            return await replica_stats(address, tls, timeout, at_least)
        except RetrievalError as exc:
            return exc

    shards = parse_addresses(spec)
    wanted = list(applied_at_least) + [""] * (len(shards) - len(applied_at_least))
    flat = await asyncio.gather(
        *(one(a, wanted[s]) for s, replicas in enumerate(shards) for a in replicas)
    )
    out: list[list[ReplicaStats | RetrievalError]] = []
    n = 0
    for replicas in shards:
        out.append(list(flat[n : n + len(replicas)]))
        n += len(replicas)
    return out
