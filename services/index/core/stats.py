"""What a shard replica reports about itself (the ``Stats`` RPC), free of grpc.

:class:`ReplicaStats` is one object for :func:`services.index.convert.stats_to_pb`: the
shard core's own figures (:class:`~services.index.core.shard.ShardStats`), the trained
index it serves (:class:`~services.index.core.trained.Manifest`) and where the replica
stands (its log lag, its newest snapshot, whether it searches on a GPU, how many query
vectors it answered). :meth:`services.index.server.service.ShardService.replica_stats`
builds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.index.core.shard import ShardStats
from services.index.core.trained import Manifest


@dataclass(frozen=True)
class ReplicaStats:
    shard: int  # the shard this replica serves
    replica: str  # the replica's name
    index: ShardStats  # the shard core's figures: vectors, memory, PQ error, list balance
    manifest: Manifest  # the trained index it serves: dim, factory, model, nlist, nprobe
    snapshot_position: str  # the log position of its newest snapshot ("" before the first)
    log_lag_s: float  # seconds its applied position is behind its log's newest entry
    gpu: bool = False  # searches served from a GPU copy
    searches: int = 0  # query vectors answered since it started
    generation: str = "g1"  # the index generation it serves (docs/generations.md)
