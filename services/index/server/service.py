"""What a shard replica answers, free of grpc: consistency waits, then a batched search."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.deadline import Deadline
from services.common.errors import InvalidArgument, Unavailable
from services.common.limits import LIMITS
from services.common.positions import Position
from services.index.core.query import Consistency, DenseQuery, ShardAnswer, ShardQuery, TopK
from services.index.core.shard import ShardStats, VectorExport
from services.index.core.stats import ReplicaStats
from services.index.core.transfer import Offer, newest_snapshot, open_offer
from services.index.keys import FIRST_GENERATION
from services.index.server.batcher import SearchBatcher
from services.index.server.replica import ShardReplica
from services.telemetry import tracing

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
        shard = self.replica.shard
        dense = query.k > 0 or not query.sparse_k
        vectors = (
            shard.check(query.vectors, query.k, query.nprobe, query.filter, query.probes)
            if dense
            else None
        )
        terms, unavailable = self._sparse_terms(query, dense)
        if query.consistency is Consistency.SESSION and query.min_position:
            # Parsed once, here where the request enters the shard: the waits compare
            # Positions (InvalidArgument for a malformed one, before any wait).
            wanted = Position.parse(query.min_position)
            with tracing.span("wait for log position") as span:
                if span:
                    span.set_attribute("gtr.log.position", query.min_position)
                await self.replica.check_written(wanted, deadline.remaining())
                await self.replica.wait_for(wanted, deadline.remaining())
        elif query.consistency is Consistency.STRONG:
            with tracing.span("wait for log tail"):
                await self.replica.wait_for(await self.replica.tail(), deadline.remaining())
        deadline.check("the search")
        if vectors is not None:
            checked = DenseQuery(vectors, query.k, query.nprobe, query.filter, query.probes)
            with tracing.span("dense search (IVF-PQ)") as span:
                if span:
                    span.set_attributes(
                        {"gtr.queries": len(vectors), "gtr.k": query.k, "gtr.nprobe": query.nprobe}
                    )
                top = await self.batcher.search(checked, checked=True)
        else:
            top = TopK.empty(len(query.texts), 0)
        # BM25 inline on the event loop: 0.10-0.33 ms per query on half of 5,183 documents,
        # by k (10, 100) and Tantivy segments (1-7; docs/performance.md, bench.hybrid)
        sparse = None
        if terms:
            with tracing.span("BM25 search (Tantivy)") as span:
                if span:
                    span.set_attributes({"gtr.queries": len(terms), "gtr.k": query.sparse_k})
                sparse = shard.search_text(terms, query.sparse_k, query.filter)
        self.searches += top.rows
        return ShardAnswer(
            top,
            self.shard_id,
            self.replica.config.replica,
            shard.applied,
            sparse=sparse,
            sparse_unavailable=unavailable,
        )

    def _sparse_terms(self, query: ShardQuery, dense: bool) -> tuple[list[list[str]], str]:
        """The analysed terms of the query texts (none when no sparse list is asked), or
        why there are none although asked (this replica has no text index); the one check
        of the sparse part."""
        if not query.sparse_k and not query.texts:
            return [], ""
        if not 1 <= query.sparse_k <= LIMITS.max_k:
            raise InvalidArgument(f"sparse_k: {query.sparse_k} is out of range 1..{LIMITS.max_k}")
        if not 1 <= len(query.texts) <= LIMITS.max_shard_queries:
            raise InvalidArgument(
                f"texts: {len(query.texts)} query texts, takes 1..{LIMITS.max_shard_queries}"
            )
        if dense and len(query.texts) != len(query.vectors):
            raise InvalidArgument(
                f"texts: {len(query.texts)} query texts for {len(query.vectors)} query vectors"
            )
        for text in query.texts:
            if len(text.encode("utf-8")) > LIMITS.max_query_bytes:
                raise InvalidArgument(f"texts: a query text over {LIMITS.max_query_bytes} bytes")
        shard = self.replica.shard
        shard.check_filter(query.filter)
        if shard.text is None:
            return [], (
                f"shard {self.shard_id} replica {self.replica.config.replica} has no text "
                "index: dense results only"
            )
        return shard.query_terms(query.texts), ""

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
            generation=replica.generation,
        )

    def snapshot_offer(self, shard: int, with_index: bool, generation: str = "") -> Offer:
        """The newest snapshot (written now when there is none), opened for a peer of
        this shard and generation ("" = g1); blocking (file reads and hashing): run it in
        a thread."""
        if shard != self.shard_id:
            raise InvalidArgument(f"shard: this replica serves shard {self.shard_id}, not {shard}")
        if (generation or FIRST_GENERATION) != self.replica.generation:
            raise InvalidArgument(
                f"generation: this replica serves generation {self.replica.generation}, not "
                f"{generation or FIRST_GENERATION}"
            )
        if not self.replica.ready.is_set():
            raise Unavailable(f"shard {self.shard_id} replica is not serving yet")
        config = self.replica.config
        snapshot = newest_snapshot(Path(config.snapshot_dir)) or self.replica.snapshot()
        return open_offer(snapshot, Path(config.index_dir) if with_index else None)

    def export(self) -> VectorExport:
        """Every id this replica holds with its SQ8 code, at one position (the
        ExportVectors RPC decodes them chunk by chunk); Unavailable until it serves."""
        if not self.replica.ready.is_set():
            raise Unavailable(f"shard {self.shard_id} replica is not serving yet")
        return self.replica.shard.export_codes()
