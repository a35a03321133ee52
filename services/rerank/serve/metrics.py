"""Reranker metrics, created on an injected registry (never at import)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.rpc.metrics import BATCH_BUCKETS, latency_histogram


@dataclass
class RerankMetrics:
    latency: Histogram  # wall time of one scoring call (all batches of one request)
    pairs: Counter  # (query, candidate) pairs scored
    batch_size: Histogram  # pairs per forward pass

    @classmethod
    def create(cls, registry: CollectorRegistry) -> RerankMetrics:
        return cls(
            latency=latency_histogram(
                "rerank_score_seconds",
                "Time to score all pairs of one request.",
                registry=registry,
            ),
            pairs=Counter("rerank_pairs", "(query, candidate) pairs scored.", registry=registry),
            batch_size=Histogram(
                "rerank_batch_pairs",
                "Pairs per forward pass.",
                buckets=BATCH_BUCKETS,
                registry=registry,
            ),
        )
