"""The gateway's core: search = encode → fan-out → fetch → (rerank); writes = encode → log.

A search's first stage is dense (the query embedding), sparse (BM25 in the shards' text
indexes; the query is not encoded) or hybrid (both lists from one fan-out, each merged
over the shards by the router, then fused here by :mod:`services.common.fusion`); the
reranker reorders what that stage found.

No grpc here: the servicer converts protos to the domain objects of
:mod:`services.gateway.domain` and back, and every stage is reached through the
protocols of :mod:`services.gateway.ports`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from services.common.deadline import Deadline
from services.common.domain import IndexResult
from services.common.errors import DeadlineExceeded, FailedPrecondition, NotFound
from services.common.fusion import Fusion, Mode, RetrievalDefaults, fuse_hits
from services.common.limits import Limits
from services.encoder.base import Embeddings
from services.gateway import validation
from services.gateway.domain import (
    Consistency,
    Document,
    Hit,
    SearchQuery,
    SearchResult,
    Timings,
    WriteResult,
)
from services.gateway.metrics import GatewayMetrics
from services.gateway.ports import (
    DocRecord,
    DocumentStore,
    DocumentWriter,
    Encoder,
    LogTails,
    Reranker,
    VectorIndex,
)
from services.gateway.query_cache import QueryEmbeddingCache
from services.gateway.texts import cut_for_encoder

log = logging.getLogger(__name__)

# Share of the remaining budget that rerank may use when it picks its own depth.
RERANK_BUDGET_SHARE = 0.6
# The deadline of a request that brings none (GatewaySettings.default_timeout_s).
DEFAULT_TIMEOUT_S = 10.0

T = TypeVar("T")


# Kept from the index search for what follows it (document fetch, rerank, answer): a
# share of the request's whole budget, taken at its start. The router keeps a share of
# what is left when it is called, which shrinks with the time the encoder took: with
# both replicas of a shard hung, the router answered concurrent 1 s searches with 5 to
# 90 ms left, too little for the rest, and they ended DEADLINE_EXCEEDED, not partial.
AFTER_SEARCH_SHARE = 0.1
AFTER_SEARCH_MIN_S = 0.005


# A rerank whose depth the gateway chose (depth 0) is planned from the measured depth
# table, which a machine busier than the one it was measured on overruns: on the 2-core
# machine at load 10, depth 100 took 22 s where the table says 5.3 s, and the README's
# `search "parse command line arguments" -k 10 --rerank` (a 10 s deadline) ended
# DEADLINE_EXCEEDED. Such a rerank gets the time left less this reserve for the answer;
# when it does not finish in it, the hits keep their first-stage order and the response
# says so (rerank_skipped), as when no measured depth fits. A named depth keeps the whole
# deadline and fails with it.
RERANK_RESERVE_SHARE = 0.05
RERANK_RESERVE_MIN_S = 0.02


def rerank_deadline(deadline: Deadline) -> Deadline:
    """``deadline`` less the reserve an automatic-depth rerank leaves for the answer."""
    left = deadline.remaining()
    if deadline.at is None or left is None:
        return deadline
    return Deadline(deadline.at - max(RERANK_RESERVE_MIN_S, left * RERANK_RESERVE_SHARE))


def search_deadline(deadline: Deadline, budget: float) -> Deadline:
    """``deadline`` less the time kept for what follows the index search."""
    if deadline.at is None:
        return deadline
    return Deadline(deadline.at - max(AFTER_SEARCH_MIN_S, budget * AFTER_SEARCH_SHARE))


async def bounded(step: Awaitable[T], deadline: Deadline, stage: str) -> T:
    """Await ``step`` for at most what is left of ``deadline`` (DeadlineExceeded after)."""
    try:
        async with asyncio.timeout(deadline.remaining()):
            return await step
    except TimeoutError:
        raise DeadlineExceeded(f"deadline exceeded during {stage}") from None


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0


@dataclass(frozen=True)
class _Stage:
    """How one query's first stage runs: its mode, each list's depth, the fusion."""

    mode: Mode
    dense_k: int  # 0: no dense list
    sparse_k: int  # 0: no sparse list
    fusion: Fusion | None  # hybrid only


@dataclass
class _Found:
    """One query's first-stage hits and the shards missing from them."""

    hits: list[Hit]
    missing: list[int]
    sparse_missing: list[int] = field(default_factory=list)


def first_stage(stage: _Stage, result: IndexResult, row: int, k: int) -> list[Hit]:
    """The ``k`` hits of one query row: the dense list, the sparse one (ranked), or both
    fused (each hit's ranks kept; its first-stage score the fused one)."""
    dense = result.hits[row] if stage.dense_k else []
    sparse = result.sparse[row] if stage.sparse_k and result.sparse is not None else []
    if stage.mode is Mode.DENSE:
        return dense[:k]
    if stage.mode is Mode.SPARSE:
        for rank, hit in enumerate(sparse, 1):
            hit.sparse_rank = rank
        return sparse[:k]
    assert stage.fusion is not None
    return fuse_hits(dense, sparse, stage.fusion, k)


def _group_key(q: SearchQuery, fetch_k: int, stage: _Stage) -> tuple[object, ...]:
    return (
        fetch_k,
        stage.dense_k,
        stage.sparse_k,
        q.nprobe,
        q.filter,
        q.consistency,
        tuple(sorted(q.write_token.items())),
        q.require_complete,
    )


@dataclass
class SearchPipeline:
    encoder: Encoder
    index: VectorIndex
    documents: DocumentStore
    tails: LogTails
    reranker: Reranker | None = None
    limits: Limits = field(default_factory=Limits)
    metrics: GatewayMetrics | None = None
    default_timeout_s: float = DEFAULT_TIMEOUT_S
    # 0..1, how far in-flight requests are past the high-water mark (1: at the limit);
    # services.common.server.Admission.pressure. Rerank is shed by it.
    pressure: Callable[[], float] = field(default=lambda: 0.0)
    # Query embeddings kept in Redis (--query-cache); None: every query is encoded.
    query_cache: QueryEmbeddingCache | None = None
    # What a query that names no mode or fusion gets (--default-mode, --fusion, ...).
    retrieval: RetrievalDefaults = field(default_factory=RetrievalDefaults)

    async def search(self, query: SearchQuery, timeout: float | None) -> SearchResult:
        return (await self.search_batch([query], timeout, batch=False))[0]

    async def search_batch(
        self, queries: Sequence[SearchQuery], timeout: float | None, batch: bool = True
    ) -> list[SearchResult]:
        """``timeout``: the client's deadline in seconds; None (the client set none) takes
        ``default_timeout_s``: every wait below is bounded by what is left of it."""
        start = time.perf_counter()
        budget = self.default_timeout_s if timeout is None else timeout
        deadline = Deadline.after(budget)
        if batch:
            validation.check_batch(queries, self.limits, self.index.num_shards)
        else:
            validation.check_query(queries[0], self.limits, self.index.num_shards)
        if any(q.rerank for q in queries) and self.reranker is None:
            raise FailedPrecondition("rerank: no rerank service is configured on this gateway")

        plans = [self._rerank_depth(q, deadline) for q in queries]
        depths = [depth for depth, _ in plans]
        fetch_ks = [max(q.k, d) for q, d in zip(queries, depths, strict=True)]
        stages = [self._stage(q, fk) for q, fk in zip(queries, fetch_ks, strict=True)]

        t = time.perf_counter()
        vectors, truncated, cached = await self._embed_dense(queries, stages, deadline)
        encode_ms = _ms(t) if any(s.dense_k for s in stages) else 0.0  # sparse: no encode

        t = time.perf_counter()
        routed = await self._strong_as_session(queries, deadline)
        found = await self._search_index(
            routed, fetch_ks, stages, vectors, search_deadline(deadline, budget)
        )
        search_ms = _ms(t)

        index_results = [(f.hits, f.missing) for f in found]
        fetch_ms = await self._fetch_documents(queries, depths, index_results, deadline)
        results = await asyncio.gather(
            *[
                self._finish(q, plan, hits, missing, deadline)
                for q, plan, (hits, missing) in zip(queries, plans, index_results, strict=True)
            ]
        )
        for result, stage, f in zip(results, stages, found, strict=True):
            result.mode = stage.mode
            result.fusion = stage.fusion
            result.sparse_missing_shards = f.sparse_missing
            result.partial = result.partial or bool(f.sparse_missing)
        total_ms = _ms(start)
        for result, cut, from_cache in zip(results, truncated, cached, strict=True):
            result.model = self.encoder.model_name
            result.query_truncated = cut
            result.embedding_cached = from_cache
            result.timings.encode_ms = encode_ms
            result.timings.search_ms = search_ms
            result.timings.fetch_ms = fetch_ms
            result.timings.total_ms = total_ms
        if self.metrics is not None:
            self.metrics.observe_request(results, None if batch else queries[0].rerank)
        return list(results)

    def _stage(self, q: SearchQuery, fetch_k: int) -> _Stage:
        mode = q.mode or self.retrieval.mode
        if mode is Mode.DENSE:
            return _Stage(mode, fetch_k, 0, None)
        if mode is Mode.SPARSE:
            return _Stage(mode, 0, fetch_k, None)
        depth = max(fetch_k, q.candidates or self.retrieval.candidates)
        return _Stage(mode, depth, depth, q.fusion or self.retrieval.fusion)

    async def _embed_dense(
        self, queries: Sequence[SearchQuery], stages: Sequence[_Stage], deadline: Deadline
    ) -> tuple[np.ndarray, list[bool], list[bool]]:
        """:meth:`_embed` of the queries that have a dense list (a sparse one is not
        encoded: its row of vectors stays zero and unused)."""
        rows = [i for i, s in enumerate(stages) if s.dense_k]
        if len(rows) == len(queries):
            return await self._embed([q.text for q in queries], deadline)
        vectors = np.zeros((len(queries), self.encoder.dim), dtype=np.float32)
        truncated, cached = [False] * len(queries), [False] * len(queries)
        if rows:
            vecs, cut, hit = await self._embed([queries[i].text for i in rows], deadline)
            vectors[rows] = vecs
            for j, i in enumerate(rows):
                truncated[i], cached[i] = cut[j], hit[j]
        return vectors, truncated, cached

    async def _encode(self, texts: list[str], deadline: Deadline) -> Embeddings:
        """One encoder call, recorded once for the encode SLI (a BatchSearch's batch is
        one call; one that fails or times out is a miss)."""
        t = time.perf_counter()
        try:
            embedded = await self.encoder.encode(texts, "query", timeout=deadline.remaining())
        except Exception:
            if self.metrics is not None:
                self.metrics.observe_encode(None)
            raise
        if self.metrics is not None:
            self.metrics.observe_encode(time.perf_counter() - t)
        return embedded

    async def _embed(
        self, texts: list[str], deadline: Deadline
    ) -> tuple[np.ndarray, list[bool], list[bool]]:
        """(vectors, truncated, from the cache) per text. With the query cache: one
        lookup for all texts, one encoder call for the distinct misses (texts with one
        normal form are encoded once), the new embeddings stored in the background."""
        cache = self.query_cache
        if cache is None:
            embedded = await self._encode(texts, deadline)
            return embedded.vectors, list(embedded.truncated), [False] * len(texts)
        keys = cache.keys(texts, "query")
        found = await cache.lookup(keys, timeout=deadline.remaining())
        vectors = np.empty((len(texts), self.encoder.dim), dtype=np.float32)
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
            embedded = await self._encode(miss_texts, deadline)
            for group, row, cut in zip(
                misses.values(), embedded.vectors, embedded.truncated, strict=True
            ):
                for i in group:
                    vectors[i] = row
                    truncated[i] = cut
            cache.store(list(misses), embedded.vectors, embedded.truncated)
        return vectors, truncated, [hit is not None for hit in found]

    def _rerank_depth(self, q: SearchQuery, deadline: Deadline) -> tuple[int, str]:
        """(depth, why the rerank is skipped). The depth the request names, else the
        largest one the reranker's table fits into its share of the time left (at least
        k); none fits: (0, the reason), the hits keep their first-stage order.

        Under load the rerank is the optional work shed first: past the gateway's
        high-water mark of in-flight requests the named depth, or the budget the depth
        is chosen by, shrinks by ``1 - pressure`` (never below k), and at the limit the
        rerank is skipped and the response says so; searches are refused only over it.
        """
        if not q.rerank or self.reranker is None:
            return 0, ""
        keep = 1.0 - self.pressure()
        if keep <= 0.0:
            return 0, "shed under load: the gateway is at its limit of in-flight requests"
        if q.rerank_depth:
            return max(min(q.k, q.rerank_depth), int(q.rerank_depth * keep)), ""
        budget = deadline.remaining_ms(default=1000.0) * RERANK_BUDGET_SHARE * keep
        depth = self.reranker.depth_for_budget(budget)
        if depth == 0:
            return 0, (
                f"no measured rerank depth fits {budget:.0f} ms "
                f"({RERANK_BUDGET_SHARE:.0%} of the time left"
                + (f", {keep:.0%} of it under load)" if keep < 1.0 else ")")
            )
        return max(q.k, depth), ""

    async def _strong_as_session(
        self, queries: Sequence[SearchQuery], deadline: Deadline
    ) -> Sequence[SearchQuery]:
        """STRONG reads wait for the log tails as of now: read once for the whole request
        (one pipelined Redis round trip) and sent as a SESSION token. A tail that cannot
        be read fails the request with Unavailable: without it a STRONG read has nothing
        to promise (a shard reading its own tail would only drop out as a partial)."""
        if not any(q.consistency is Consistency.STRONG for q in queries):
            return queries
        tail = await bounded(self.tails.tail(), deadline, "reading the log tails")
        return [
            dataclasses.replace(q, consistency=Consistency.SESSION, write_token=tail)
            if q.consistency is Consistency.STRONG
            else q
            for q in queries
        ]

    async def _fetch_documents(
        self,
        queries: Sequence[SearchQuery],
        depths: Sequence[int],
        results: list[tuple[list[Hit], list[int]]],
        deadline: Deadline,
    ) -> float:
        """Attach the stored documents to the hits that need them (the response's, or the
        reranker's candidates), all queries in one round trip; drop hits whose document
        was deleted after the shards answered. ``ids_only`` without rerank fetches nothing.
        Returns the milliseconds spent (0 when nothing was fetched).
        """
        wanted = [
            i for i, (q, d) in enumerate(zip(queries, depths, strict=True)) if not q.ids_only or d
        ]
        ids = list(dict.fromkeys(h.id for i in wanted for h in results[i][0]))
        if not ids:
            return 0.0
        t = time.perf_counter()
        docs = await bounded(self.documents.get_many(ids), deadline, "the document fetch")
        fetch_ms = _ms(t)
        by_id = dict(zip(ids, docs, strict=True))
        for i in wanted:
            hits, missing = results[i]
            kept = []
            for hit in hits:
                doc = by_id[hit.id]
                if doc is None:  # deleted since the shard answered: never return it
                    continue
                hit.document = doc
                kept.append(hit)
            results[i] = (kept, missing)
        return fetch_ms

    async def _search_index(
        self,
        queries: Sequence[SearchQuery],
        fetch_ks: Sequence[int],
        stages: Sequence[_Stage],
        vectors: np.ndarray,
        deadline: Deadline,
    ) -> list[_Found]:
        """One index call per group of queries that share their search parameters."""
        groups: dict[tuple[object, ...], list[int]] = {}
        for i, (q, fk, stage) in enumerate(zip(queries, fetch_ks, stages, strict=True)):
            groups.setdefault(_group_key(q, fk, stage), []).append(i)

        out: list[_Found] = [_Found([], [])] * len(queries)

        async def run(rows: list[int]) -> None:
            first, stage = queries[rows[0]], stages[rows[0]]
            result = await self.index.search(
                vectors[rows] if stage.dense_k else None,
                stage.dense_k,
                nprobe=first.nprobe,
                filter=first.filter,
                consistency=first.consistency,
                write_token=first.write_token,
                timeout=deadline.remaining(),
                require_complete=first.require_complete,
                texts=[queries[i].text for i in rows] if stage.sparse_k else (),
                sparse_k=stage.sparse_k,
            )
            for j, row in enumerate(rows):
                out[row] = _Found(
                    first_stage(stages[row], result, j, fetch_ks[row]),
                    list(result.missing_shards),
                    list(result.sparse_missing_shards) if stage.sparse_k else [],
                )

        await asyncio.gather(*[run(rows) for rows in groups.values()])
        return out

    async def _finish(
        self,
        q: SearchQuery,
        plan: tuple[int, str],
        hits: list[Hit],
        missing: list[int],
        deadline: Deadline,
    ) -> SearchResult:
        timings = Timings()
        depth, skipped = plan
        result = SearchResult(
            hits=hits, model="", partial=bool(missing), missing_shards=missing, timings=timings,
            rerank_skipped=bool(skipped), rerank_skipped_reason=skipped,
        )  # fmt: skip
        if depth > 0 and self.reranker is not None and hits:
            t = time.perf_counter()
            candidates = hits[:depth]
            chosen = not q.rerank_depth  # the depth is the gateway's estimate
            bound = rerank_deadline(deadline) if chosen else deadline
            try:
                hits = await bounded(
                    self.reranker.rerank(q.text, candidates, timeout=bound.remaining()),
                    bound,
                    "the rerank",
                )
            except DeadlineExceeded:
                if not chosen:
                    raise
                result.rerank_skipped = True
                result.rerank_skipped_reason = (
                    f"the rerank of {len(candidates)} candidates did not finish in the "
                    f"{_ms(t):.0f} ms left (its depth was chosen from the measured depth "
                    "table, which this reranker is slower than now)"
                )
            else:
                result.reranked = True
                result.rerank_depth = len(candidates)
            timings.rerank_ms = _ms(t)
        if q.ids_only:
            for hit in hits:
                hit.document = None
        result.hits = hits[: q.k]
        return result


@dataclass
class DocumentPipeline:
    encoder: Encoder
    writer: DocumentWriter
    documents: DocumentStore
    limits: Limits = field(default_factory=Limits)
    default_timeout_s: float = DEFAULT_TIMEOUT_S

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline.after(self.default_timeout_s if timeout is None else timeout)

    async def upsert(self, docs: Sequence[Document], timeout: float | None) -> WriteResult:
        """Encode (only what the model reads, see :mod:`services.gateway.texts`), then
        store the whole documents and log them."""
        deadline = self._deadline(timeout)
        validation.check_documents(docs, self.limits)
        cuts = [cut_for_encoder(d.embedding_text) for d in docs]
        texts = [text for text, _ in cuts]
        step = max(1, self.encoder.max_batch)
        chunks = await asyncio.gather(
            *[
                self.encoder.encode(texts[i : i + step], "document", timeout=deadline.remaining())
                for i in range(0, len(texts), step)
            ]
        )
        vectors = np.concatenate([c.vectors for c in chunks])
        flags = [t for c in chunks for t in c.truncated]
        truncated = sum(f or cut for f, (_, cut) in zip(flags, cuts, strict=True))
        records = [
            DocRecord(d.id, vectors[i], d.title, d.text, dict(d.metadata))
            for i, d in enumerate(docs)
        ]
        token = await bounded(self.writer.upsert(records), deadline, "the write")
        return WriteResult(token, len(docs), truncated=truncated)

    async def delete(self, ids: Sequence[str], timeout: float | None = None) -> WriteResult:
        deadline = self._deadline(timeout)
        validation.check_ids(ids, self.limits)
        token, deleted, missing = await bounded(self.writer.delete(ids), deadline, "the delete")
        return WriteResult(token, len(deleted), not_found=tuple(missing))

    async def get(self, doc_id: str, timeout: float | None = None) -> Document:
        deadline = self._deadline(timeout)
        validation.check_id(doc_id, self.limits)
        (doc,) = await bounded(self.documents.get_many([doc_id]), deadline, "the read")
        if doc is None:
            raise NotFound(f"document {doc_id!r} does not exist")
        return doc
