"""Gateway metrics, on a registry injected by the server."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics import LATENCY_BUCKETS
from services.gateway.domain import SearchResult


@dataclass
class GatewayMetrics:
    stage_seconds: Histogram
    encode_seconds: Histogram
    partial_results: Counter
    searches: Counter
    model: str
    size: str

    @classmethod
    def create(
        cls,
        registry: CollectorRegistry,
        model: str,
        size: str,
        encode_slo_ms: float | None = None,
        search_slo_ms: float | None = None,
    ) -> GatewayMetrics:
        """``*_slo_ms``: the latency objectives this gateway runs under, exported as
        ``gtr_slo_seconds{objective}`` so that dashboards and alerts read the same
        numbers as the configuration (the chart sets them from the size profile)."""
        slo = Gauge(
            "gtr_slo_seconds",
            "Latency objective this gateway runs under (encode: the size profile's).",
            ["objective", "model", "size"],
            registry=registry,
        )
        for objective, ms in (("encode", encode_slo_ms), ("search", search_slo_ms)):
            if ms is not None:
                slo.labels(objective, model, size).set(ms / 1000.0)
        return cls(
            stage_seconds=Histogram(
                "gateway_stage_seconds",
                "Wall time per search stage (encode, search, fetch, rerank, total).",
                ["stage", "model", "size"],
                buckets=LATENCY_BUCKETS,
                registry=registry,
            ),
            encode_seconds=Histogram(
                "gtr_encode_seconds",
                "Query encoding time seen by the gateway (the encoder SLO's metric).",
                ["model", "size"],
                buckets=LATENCY_BUCKETS,
                registry=registry,
            ),
            partial_results=Counter(
                "gateway_partial_results_total",
                "Searches answered with some shards missing.",
                registry=registry,
            ),
            searches=Counter(
                "gateway_searches_total",
                "Searches answered, by whether they were reranked.",
                ["reranked"],
                registry=registry,
            ),
            model=model,
            size=size,
        )

    def observe_search(self, result: SearchResult) -> None:
        t = result.timings
        for stage, ms in (
            ("encode", t.encode_ms),
            ("search", t.search_ms),
            ("fetch", t.fetch_ms),
            ("rerank", t.rerank_ms),
            ("total", t.total_ms),
        ):
            if ms or stage == "total":
                self.stage_seconds.labels(stage, self.model, self.size).observe(ms / 1000.0)
        if not result.embedding_cached:  # the encoder's latency, not the cache's
            self.encode_seconds.labels(self.model, self.size).observe(t.encode_ms / 1000.0)
        if result.partial:
            self.partial_results.inc()
        self.searches.labels(str(result.reranked).lower()).inc()


@dataclass
class QueryCacheMetrics:
    """The query-embedding cache (services/gateway/query_cache.py)."""

    lookups: Counter
    errors: Counter
    stores: Counter
    evictions: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> QueryCacheMetrics:
        return cls(
            lookups=Counter(
                "gateway_query_cache_lookups_total",
                "Query embeddings looked up in the cache, by result: hit, miss, error (the "
                "lookup failed or was too slow; encoded instead), bypassed (skipped while "
                "the cache's Redis recently failed).",
                ["result"],
                registry=registry,
            ),
            errors=Counter(
                "gateway_query_cache_errors_total",
                "Failed cache operations (lookup, store); a search never fails by one.",
                ["op"],
                registry=registry,
            ),
            stores=Counter(
                "gateway_query_cache_stores_total",
                "Embeddings written to the cache (stored), or not (dropped: too many "
                "writes pending or the cache bypassed).",
                ["result"],
                registry=registry,
            ),
            evictions=Counter(
                "gateway_query_cache_evictions_total",
                "Entries evicted (least recently used) to keep the cache's size bound.",
                registry=registry,
            ),
        )
