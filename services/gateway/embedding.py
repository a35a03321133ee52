"""A search's query embeddings: the encoder call (recorded for the encode SLI) and the
query-embedding cache in front of it.

No grpc here (see :mod:`services.gateway.pipeline`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.common.deadline import Deadline
from services.encoder.base import Embeddings
from services.gateway.domain import SearchQuery
from services.gateway.first_stage import Stage
from services.gateway.generation_parts import Bundle
from services.gateway.metrics import GatewayMetrics
from services.gateway.query_cache import QueryEmbeddingCache


@dataclass(frozen=True)
class QueryEmbedder:
    """Embeds a request's queries with the serving generation's encoder."""

    metrics: GatewayMetrics | None = None
    # Query embeddings kept in Redis (--query-cache); None: every query is encoded.
    query_cache: QueryEmbeddingCache | None = None

    async def embed_dense(
        self,
        parts: Bundle,
        queries: Sequence[SearchQuery],
        stages: Sequence[Stage],
        deadline: Deadline,
    ) -> tuple[np.ndarray, list[bool], list[bool]]:
        """:meth:`embed` of the queries that have a dense list (a sparse one is not
        encoded: its row of vectors stays zero and unused)."""
        rows = [i for i, s in enumerate(stages) if s.dense_k]
        if len(rows) == len(queries):
            return await self.embed(parts, [q.text for q in queries], deadline)
        vectors = np.zeros((len(queries), parts.encoder.dim), dtype=np.float32)
        truncated, cached = [False] * len(queries), [False] * len(queries)
        if rows:
            vecs, cut, hit = await self.embed(parts, [queries[i].text for i in rows], deadline)
            vectors[rows] = vecs
            for j, i in enumerate(rows):
                truncated[i], cached[i] = cut[j], hit[j]
        return vectors, truncated, cached

    async def encode(self, parts: Bundle, texts: list[str], deadline: Deadline) -> Embeddings:
        """One encoder call, recorded once for the encode SLI (a BatchSearch's batch is
        one call; one that fails or times out is a miss)."""
        t = time.perf_counter()
        try:
            embedded = await parts.encoder.encode(texts, "query", timeout=deadline.remaining())
        except Exception:
            if self.metrics is not None:
                self.metrics.observe_encode(None, parts.encoder.model_name)
            raise
        if self.metrics is not None:
            self.metrics.observe_encode(time.perf_counter() - t, parts.encoder.model_name)
        return embedded

    async def embed(
        self, parts: Bundle, texts: list[str], deadline: Deadline
    ) -> tuple[np.ndarray, list[bool], list[bool]]:
        """(vectors, truncated, from the cache) per text. With the query cache: one
        lookup for all texts, one encoder call for the distinct misses (texts with one
        normal form are encoded once), the new embeddings stored in the background. The
        cache keys on the generation's encoder (model, version, digest)."""
        cache = self.query_cache
        if cache is None:
            embedded = await self.encode(parts, texts, deadline)
            return embedded.vectors, list(embedded.truncated), [False] * len(texts)
        dim = parts.encoder.dim
        keys = cache.keys(texts, "query", encoder=parts.encoder_id, dim=dim)
        found = await cache.lookup(keys, timeout=deadline.remaining(), dim=dim)
        vectors = np.empty((len(texts), dim), dtype=np.float32)
        truncated = [False] * len(texts)
        misses: dict[str, list[int]] = {}
        for i, (key, hit) in enumerate(zip(keys, found, strict=True)):
            if hit is None:
                misses.setdefault(key, []).append(i)
            else:
                vectors[i] = hit.vector
                truncated[i] = hit.truncated
        if misses:
            rows = [group[0] for group in misses.values()]
            miss_texts = [texts[i] for i in rows]
            embedded = await self.encode(parts, miss_texts, deadline)
            for group, row, cut in zip(
                misses.values(), embedded.vectors, embedded.truncated, strict=True
            ):
                for i in group:
                    vectors[i] = row
                    truncated[i] = cut
            cache.store(list(misses), embedded.vectors, embedded.truncated)
        return vectors, truncated, [hit is not None for hit in found]
