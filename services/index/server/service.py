"""What a shard replica answers, free of grpc: consistency waits, then a batched search."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common import positions
from services.common.deadline import Deadline
from services.common.errors import InvalidArgument, Unavailable
from services.index.core.query import Consistency, ShardAnswer, ShardQuery
from services.index.core.shard import ShardStats
from services.index.core.stats import ReplicaStats
from services.index.core.transfer import Offer, newest_snapshot, open_offer
from services.index.server.batcher import SearchBatcher
from services.index.server.replica import ShardReplica

__all__ = ["Consistency", "ShardAnswer", "ShardQuery", "ShardService"]


@dataclass
class ShardService:
    replica: ShardReplica
    batcher: SearchBatcher
    default_timeout_s: float = 10.0  # a search without a deadline gets this one
    searches: int = 0  # query vectors answered (ShardStats.searches)

    @property
    def shard_id(self) -> int:
        return self.replica.config.shard

    async def search(self, query: ShardQuery, timeout: float | None) -> ShardAnswer:
        if query.shard != self.shard_id:
            raise InvalidArgument(
                f"shard: this replica serves shard {self.shard_id}, not {query.shard}"
            )
        deadline = Deadline.after(self.default_timeout_s if timeout is None else timeout)
        # The one check of a search in this process, before any wait: a bad request
        # fails at once, whatever the consistency.
        vectors = self.replica.shard.check(
            query.vectors, query.k, query.nprobe, query.filter, query.probes
        )
        if query.consistency is Consistency.SESSION and query.min_position:
            positions.parse(query.min_position)
            await self.replica.check_written(query.min_position, deadline.remaining())
            await self.replica.wait_for(query.min_position, deadline.remaining())
        elif query.consistency is Consistency.STRONG:
            await self.replica.wait_for(await self.replica.tail(), deadline.remaining())
        deadline.check("the search")
        top = await self.batcher.search(
            vectors, query.k, query.nprobe, query.filter, query.probes, checked=True
        )
        self.searches += top.rows
        return ShardAnswer(
            top, self.shard_id, self.replica.config.replica, self.replica.shard.applied
        )

    def stats(self) -> ShardStats:
        return self.replica.shard.stats()

    def replica_stats(self) -> ReplicaStats:
        """The shard core's figures and where this replica stands (the Stats RPC)."""
        replica = self.replica
        return ReplicaStats(
            shard=replica.config.shard,
            replica=replica.config.replica,
            index=self.stats(),
            manifest=replica.trained.manifest,
            snapshot_position=replica.snapshot_position,
            log_lag_s=replica.log_lag_s,
            gpu=replica.shard.gpu is not None,
            searches=self.searches,
        )

    def snapshot_offer(self, shard: int, with_index: bool) -> Offer:
        """The newest snapshot (written now when there is none), opened for a peer of
        this shard; blocking (file reads and hashing): run it in a thread."""
        if shard != self.shard_id:
            raise InvalidArgument(f"shard: this replica serves shard {self.shard_id}, not {shard}")
        if not self.replica.ready.is_set():
            raise Unavailable(f"shard {self.shard_id} replica is not serving yet")
        config = self.replica.config
        snapshot = newest_snapshot(Path(config.snapshot_dir)) or self.replica.snapshot()
        return open_offer(snapshot, Path(config.index_dir) if with_index else None)
