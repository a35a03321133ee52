"""What a shard replica answers, free of grpc: consistency waits, then a batched search."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from services.common.deadline import Deadline
from services.common.errors import InvalidArgument
from services.index import positions
from services.index.batcher import SearchBatcher
from services.index.replica import ShardReplica
from services.index.shard import FilterSpec, Hit, ShardStats


class Consistency(enum.Enum):
    EVENTUAL = "eventual"
    SESSION = "session"
    STRONG = "strong"


@dataclass(frozen=True)
class ShardQuery:
    shard: int
    vectors: np.ndarray
    k: int
    nprobe: int = 0
    filter: FilterSpec = ()
    consistency: Consistency = Consistency.EVENTUAL
    min_position: str = ""


@dataclass
class ShardAnswer:
    hits: list[list[Hit]]
    shard: int
    replica: str
    applied_position: str


@dataclass
class ShardService:
    replica: ShardReplica
    batcher: SearchBatcher
    stats_extra: dict[str, object] = field(default_factory=dict)

    @property
    def shard_id(self) -> int:
        return self.replica.config.shard

    async def search(self, query: ShardQuery, timeout: float | None) -> ShardAnswer:
        if query.shard != self.shard_id:
            raise InvalidArgument(
                f"shard: this replica serves shard {self.shard_id}, not {query.shard}"
            )
        deadline = Deadline.after(timeout)
        if query.consistency is Consistency.SESSION and query.min_position:
            positions.parse(query.min_position)
            await self.replica.wait_for(query.min_position, deadline.remaining())
        elif query.consistency is Consistency.STRONG:
            await self.replica.wait_for(await self.replica.tail(), deadline.remaining())
        deadline.check("the search")
        hits = await self.batcher.search(query.vectors, query.k, query.nprobe, query.filter)
        return ShardAnswer(
            hits, self.shard_id, self.replica.config.replica, self.replica.shard.applied
        )

    def stats(self) -> ShardStats:
        return self.replica.shard.stats()
