"""The gateway's core: search = encode → fan-out → fetch → (rerank); writes = encode → log.

No grpc here: the servicer converts protos to the domain objects of
:mod:`services.gateway.domain` and back, and every stage is reached through the
protocols of :mod:`services.gateway.ports`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.common.deadline import Deadline
from services.common.errors import FailedPrecondition, NotFound
from services.gateway import validation
from services.gateway.domain import Document, Hit, SearchQuery, SearchResult, Timings, WriteResult
from services.gateway.limits import Limits
from services.gateway.metrics import GatewayMetrics
from services.gateway.ports import DocumentStore, QueryEncoder, Reranker, VectorIndex

log = logging.getLogger(__name__)

# Share of the remaining budget that rerank may use when it picks its own depth.
RERANK_BUDGET_SHARE = 0.6


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0


def _group_key(q: SearchQuery, fetch_k: int) -> tuple[object, ...]:
    return (
        fetch_k,
        q.nprobe,
        q.filter,
        q.consistency,
        tuple(sorted(q.write_token.items())),
        q.require_complete,
    )


@dataclass
class SearchPipeline:
    encoder: QueryEncoder
    index: VectorIndex
    store: DocumentStore
    reranker: Reranker | None = None
    limits: Limits = field(default_factory=Limits)
    metrics: GatewayMetrics | None = None

    async def search(self, query: SearchQuery, timeout: float | None) -> SearchResult:
        return (await self.search_batch([query], timeout, batch=False))[0]

    async def search_batch(
        self, queries: Sequence[SearchQuery], timeout: float | None, batch: bool = True
    ) -> list[SearchResult]:
        start = time.perf_counter()
        deadline = Deadline.after(timeout)
        if batch:
            validation.check_batch(queries, self.limits, self.index.num_shards)
        else:
            validation.check_query(queries[0], self.limits, self.index.num_shards)
        if any(q.rerank for q in queries) and self.reranker is None:
            raise FailedPrecondition("rerank: no rerank service is configured on this gateway")

        t = time.perf_counter()
        embedded = await self.encoder.encode(
            [q.text for q in queries], "query", timeout=deadline.remaining()
        )
        encode_ms = _ms(t)

        depths = [self._rerank_depth(q, deadline) for q in queries]
        fetch_ks = [max(q.k, d) for q, d in zip(queries, depths, strict=True)]
        t = time.perf_counter()
        index_results = await self._search_index(queries, fetch_ks, embedded.vectors, deadline)
        search_ms = _ms(t)

        results = await asyncio.gather(
            *[
                self._finish(q, depth, hits, missing, deadline)
                for q, depth, (hits, missing) in zip(queries, depths, index_results, strict=True)
            ]
        )
        total_ms = _ms(start)
        for result, truncated in zip(results, embedded.truncated, strict=True):
            result.model = self.encoder.model_name
            result.query_truncated = truncated
            result.timings.encode_ms = encode_ms
            result.timings.search_ms = search_ms
            result.timings.total_ms = total_ms
            if self.metrics is not None:
                self.metrics.observe_search(result)
        return list(results)

    def _rerank_depth(self, q: SearchQuery, deadline: Deadline) -> int:
        if not q.rerank or self.reranker is None:
            return 0
        if q.rerank_depth:
            return q.rerank_depth
        budget = deadline.remaining_ms(default=1000.0) * RERANK_BUDGET_SHARE
        return max(q.k, self.reranker.depth_for_budget(budget))

    async def _search_index(
        self,
        queries: Sequence[SearchQuery],
        fetch_ks: Sequence[int],
        vectors: np.ndarray,
        deadline: Deadline,
    ) -> list[tuple[list[Hit], list[int]]]:
        """One index call per group of queries that share their search parameters."""
        groups: dict[tuple[object, ...], list[int]] = {}
        for i, (q, fk) in enumerate(zip(queries, fetch_ks, strict=True)):
            groups.setdefault(_group_key(q, fk), []).append(i)

        out: list[tuple[list[Hit], list[int]]] = [([], [])] * len(queries)

        async def run(rows: list[int]) -> None:
            first = queries[rows[0]]
            result = await self.index.search(
                vectors[rows],
                fetch_ks[rows[0]],
                nprobe=first.nprobe,
                filter=first.filter,
                consistency=first.consistency,
                write_token=first.write_token,
                timeout=deadline.remaining(),
                require_complete=first.require_complete,
            )
            for row, hits in zip(rows, result.hits, strict=True):
                out[row] = (
                    [Hit(h.doc_id, h.score, h.score, h.shard) for h in hits],
                    list(result.missing_shards),
                )

        await asyncio.gather(*[run(rows) for rows in groups.values()])
        return out

    async def _finish(
        self,
        q: SearchQuery,
        depth: int,
        hits: list[Hit],
        missing: list[int],
        deadline: Deadline,
    ) -> SearchResult:
        timings = Timings()
        result = SearchResult(
            hits=hits, model="", partial=bool(missing), missing_shards=missing, timings=timings
        )
        need_docs = not q.ids_only or depth > 0
        if need_docs and hits:
            t = time.perf_counter()
            docs = await self.store.get_many([h.id for h in hits])
            timings.fetch_ms = _ms(t)
            kept = []
            for hit, doc in zip(hits, docs, strict=True):
                if doc is None:  # deleted since the shard answered: never return it
                    continue
                hit.document = doc
                kept.append(hit)
            hits = kept
        if depth > 0 and self.reranker is not None and hits:
            t = time.perf_counter()
            candidates = hits[:depth]
            scored = await self.reranker.rerank(
                q.text,
                [(h.id, h.document.embedding_text if h.document else "") for h in candidates],
                timeout=deadline.remaining(),
            )
            hits = []
            for index, score in scored:
                hit = candidates[index]
                hit.score = score
                hits.append(hit)
            timings.rerank_ms = _ms(t)
            result.reranked = True
            result.rerank_depth = len(candidates)
        if q.ids_only:
            for hit in hits:
                hit.document = None
        result.hits = hits[: q.k]
        return result


@dataclass
class DocumentPipeline:
    encoder: QueryEncoder
    store: DocumentStore
    limits: Limits = field(default_factory=Limits)

    async def upsert(self, docs: Sequence[Document], timeout: float | None) -> WriteResult:
        validation.check_documents(docs, self.limits)
        texts = [d.embedding_text for d in docs]
        step = max(1, self.encoder.max_batch)
        chunks = await asyncio.gather(
            *[
                self.encoder.encode(texts[i : i + step], "document", timeout=timeout)
                for i in range(0, len(texts), step)
            ]
        )
        vectors = np.concatenate([c.vectors for c in chunks])
        truncated = sum(sum(c.truncated) for c in chunks)
        token = await self.store.upsert(docs, vectors)
        return WriteResult(token, len(docs), truncated=truncated)

    async def delete(self, ids: Sequence[str]) -> WriteResult:
        validation.check_ids(ids, self.limits)
        token, deleted, missing = await self.store.delete(ids)
        return WriteResult(token, len(deleted), not_found=tuple(missing))

    async def get(self, doc_id: str) -> Document:
        validation.check_ids([doc_id], self.limits, field="id")
        (doc,) = await self.store.get_many([doc_id])
        if doc is None:
            raise NotFound(f"document {doc_id!r} does not exist")
        return doc
