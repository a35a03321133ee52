"""Shard metrics, on a registry injected by the server; gauges read the shard on scrape."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common import positions
from services.index.changelog import LogReader
from services.index.core.shard import IvfPqShard, ShardStats
from services.rpc.metrics import BATCH_BUCKETS, latency_histogram

log = logging.getLogger(__name__)


@dataclass
class ShardMetrics:
    search_seconds: Histogram
    batch_size: Histogram
    applied_vectors: Counter
    text_refreshes: Counter
    labels: tuple[str, str]
    registry: CollectorRegistry

    @classmethod
    def create(
        cls, registry: CollectorRegistry, shard: int, replica: str, generation: str = "g1"
    ) -> ShardMetrics:
        labels = ["shard", "replica"]
        # which index generation the replica serves (docs/generations.md), joinable on
        # (shard, replica): the other series keep their labels, so dashboards stay as they are
        Gauge(
            "index_generation_info",
            "1, labelled with the index generation this replica serves.",
            [*labels, "generation"],
            registry=registry,
        ).labels(str(shard), replica, generation).set(1)
        return cls(
            search_seconds=latency_histogram(
                "index_search_seconds",
                "Time of one FAISS search call (a micro-batch of queries).",
                labels,
                registry=registry,
            ),
            batch_size=Histogram(
                "index_search_batch_size",
                "Query vectors per FAISS search call (after micro-batching).",
                labels,
                buckets=BATCH_BUCKETS,
                registry=registry,
            ),
            applied_vectors=Counter(
                "index_apply_vectors",
                "Changes (upserts and deletes) applied from the log.",
                labels,
                registry=registry,
            ),
            text_refreshes=Counter(
                "index_text_refreshes",
                "Text index refreshes (Tantivy commits) that made applied changes "
                "searchable (services/index/server/refresh.py).",
                labels,
                registry=registry,
            ),
            labels=(str(shard), replica),
            registry=registry,
        )

    def watch_log(self, log: LogReader, applied: Callable[[], str]) -> None:
        """Gauges of how far this replica is behind its log, read from Redis on scrape (at
        most once a second), so that they move while the replica applies nothing: a
        replica whose consumer stopped falls further behind with every scrape.

        ``index_log_lag_seconds`` is the age of the oldest entry not applied yet (0 when
        caught up); the two timestamps (of the newest entry and of the one applied last)
        are stream entry times, Redis's clock. NaN while Redis cannot be read (Redis's own
        alerts say why)."""
        cache: dict[str, tuple[float, tuple[float, float, float]]] = {}

        def read() -> tuple[float, float, float]:
            now = time.monotonic()
            if "v" not in cache or now - cache["v"][0] > 1.0:
                position = applied()
                try:
                    newest, unapplied = log.tail(), log.first_after(position)
                except redis.RedisError:
                    values = (math.nan, positions.ms_of(position) / 1000.0, math.nan)
                else:
                    lag = 0.0
                    if unapplied is not None:
                        lag = max(0.0, time.time() - positions.ms_of(unapplied) / 1000.0)
                    values = (
                        positions.ms_of(newest) / 1000.0,
                        positions.ms_of(position) / 1000.0,
                        lag,
                    )
                cache["v"] = (now, values)
            return cache["v"][1]

        for name, doc, index in (
            (
                "index_log_newest_entry_timestamp_seconds",
                "Time of the newest entry of the shard's log (stream entry id).",
                0,
            ),
            (
                "index_log_applied_entry_timestamp_seconds",
                "Time of the log entry this replica applied last (stream entry id).",
                1,
            ),
            (
                "index_log_lag_seconds",
                "Age of the oldest log entry this replica has not applied (0 when caught "
                "up); grows while the replica applies nothing.",
                2,
            ),
        ):
            g = Gauge(name, doc, ["shard", "replica"], registry=self.registry)
            g.labels(*self.labels).set_function(lambda i=index: read()[i])  # type: ignore[misc]

    def bind(self, shard: IvfPqShard) -> None:
        """Gauges computed from the shard when Prometheus scrapes."""
        cache: dict[str, tuple[float, ShardStats | None]] = {}

        def stats() -> ShardStats | None:
            now = time.monotonic()
            if "s" not in cache or now - cache["s"][0] > 1.0:
                try:
                    cache["s"] = (now, shard.stats())
                except Exception:  # a scrape never fails (500) for one unreadable source
                    log.exception("shard stats unavailable: their gauges read NaN")
                    cache["s"] = (now, None)
            return cache["s"][1]

        def gauge(name: str, doc: str, read: Callable[[ShardStats], float | None]) -> None:
            def value() -> float:
                s = stats()
                v = read(s) if s is not None else None
                return math.nan if v is None else float(v)

            g = Gauge(name, doc, ["shard", "replica"], registry=self.registry)
            g.labels(*self.labels).set_function(value)

        gauge("index_vectors", "Vectors in the shard.", lambda s: s.vectors)
        gauge("index_deleted", "Documents deleted since start of the log.", lambda s: s.deleted)
        gauge(
            "index_applied_position_ms",
            "Log position applied (stream entry time, ms).",
            lambda s: positions.ms_of(s.applied_position),
        )
        gauge("index_bytes_per_vector", "Index bytes per vector.", lambda s: s.bytes_per_vector)
        gauge(
            "index_memory_bytes",
            "Index memory: codes, ids, centroids, id maps (not the id strings).",
            lambda s: s.memory_bytes,
        )
        gauge(
            "index_train_pq_error", "PQ reconstruction MSE at training.", lambda s: s.train_pq_error
        )
        gauge(
            "index_recent_pq_error",
            "PQ reconstruction MSE of recent adds.",
            lambda s: s.recent_pq_error,
        )
        gauge(
            "index_pq_error_ratio",
            "Recent PQ error / training PQ error (> 1.5: retrain the quantizers).",
            lambda s: s.pq_error_ratio,
        )
        gauge(
            "index_list_imbalance",
            "Inverted-list imbalance: sum(n_i^2)*nlist/(sum n_i)^2 (1 = even).",
            lambda s: s.list_imbalance,
        )
        # the text (BM25) index; NaN when this replica has none (serves dense only)
        gauge(
            "index_text_documents",
            "Documents in the shard's text index (NaN: no text index).",
            lambda s: s.text.documents if s.text is not None else math.nan,
        )
        gauge(
            "index_text_disk_bytes",
            "Bytes of the text index's working directory (NaN: no text index, or its "
            "directory unreadable).",
            lambda s: s.text.disk_bytes if s.text is not None else math.nan,
        )
        gauge(
            "index_text_segments",
            "Tantivy segments of the text index (merged in the background).",
            lambda s: s.text.segments if s.text is not None else math.nan,
        )
