"""The gateway's core: search = encode → fan-out → fetch → (rerank); writes = encode → log.

Each request is served by one index generation (docs/generations.md): the pipelines take
its parts (encoder, shards, documents, logs) from a
:class:`~services.gateway.generations.GenerationSource` at the start of the request, and
the answer names it. A write that finds its generation's writer gate moved (a switch)
is encoded again with the new generation's encoder and written there, within its
deadline.

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
from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    GenerationMoved,
    NotFound,
    Unavailable,
)
from services.common.fusion import Fusion, Mode, RetrievalDefaults, fuse_hits
from services.common.limits import Limits
from services.encoder.base import Embeddings
from services.encoder.texts import cut_for_encoder
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
from services.gateway.generations import Bundle, GenerationSource, Serving, resolve_token
from services.gateway.metrics import GatewayMetrics
from services.gateway.ports import DocRecord, IndexQuery, Reranker
from services.gateway.query_cache import QueryEmbeddingCache
from services.index.keys import CLOSED

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


# A write refused by its writer gate (a switch of the serving generation) is written again
# to the new serving generation after this pause, doubled per refusal up to the maximum,
# within the write's deadline (docs/generations.md: a switch pauses writes for its drain).
MOVED_BACKOFF_S = 0.01
MOVED_BACKOFF_MAX_S = 0.2
# time left, beyond the pause, below which a refused write is not tried again (nor less
# than twice its last attempt): the next attempt could not end before the deadline
MOVED_MARGIN_S = 0.05


def with_resolved_token(q: SearchQuery, serving: Serving) -> SearchQuery:
    """``q`` with its write token as positions in ``serving``'s logs
    (:func:`~services.gateway.generations.resolve_token`). A SESSION token that leaves
    nothing to wait for (the serving generation's logs were empty at its switch) is read
    as EVENTUAL."""
    if not q.write_token and not q.token_origin.epoch:
        return q
    token = resolve_token(q.write_token, q.token_origin, serving)
    if token == q.write_token and q.token_origin.epoch == serving.epoch:
        return q
    consistency = q.consistency
    if consistency is Consistency.SESSION and not token:
        consistency = Consistency.EVENTUAL
    return dataclasses.replace(q, write_token=token, consistency=consistency)


@dataclass
class SearchPipeline:
    source: GenerationSource
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
        serving = self.source.current()
        newest = max((q.token_origin.epoch for q in queries), default=0)
        if any(q.consistency is Consistency.STRONG for q in queries):
            # every write acknowledged before the request: the generation serving now, not
            # the cached one (a switch leaves it behind for up to the refresh period)
            serving = await bounded(self.source.fresh(), deadline, "reading the alias")
        elif newest > serving.epoch:  # a token of a switch this gateway has not seen yet
            serving = await bounded(self.source.at_least(newest), deadline, "reading the alias")
        with self.source.lease(serving) as parts:
            results = await self._search_on(
                serving,
                parts,
                [with_resolved_token(q, serving) for q in queries],
                budget,
                deadline,
                batch,
            )
        total_ms = _ms(start)
        for result in results:
            result.timings.total_ms = total_ms
        if self.metrics is not None:  # labelled with the answering generation's encoder
            self.metrics.observe_request(
                results, None if batch else queries[0].rerank, serving.bundle.encoder.model_name
            )
        return results

    async def _search_on(
        self,
        serving: Serving,
        parts: Bundle,
        queries: Sequence[SearchQuery],
        budget: float,
        deadline: Deadline,
        batch: bool,
    ) -> list[SearchResult]:
        """The search, wholly on one generation's parts."""
        if batch:
            validation.check_batch(
                queries, self.limits, parts.index.num_shards, self.retrieval.mode
            )
        else:
            validation.check_query(
                queries[0], self.limits, parts.index.num_shards, default_mode=self.retrieval.mode
            )
        if any(q.rerank for q in queries) and self.reranker is None:
            raise FailedPrecondition("rerank: no rerank service is configured on this gateway")

        plans = [self._rerank_depth(q, deadline) for q in queries]
        depths = [depth for depth, _ in plans]
        fetch_ks = [max(q.k, d) for q, d in zip(queries, depths, strict=True)]
        stages = [self._stage(q, fk) for q, fk in zip(queries, fetch_ks, strict=True)]

        t = time.perf_counter()
        vectors, truncated, cached = await self._embed_dense(parts, queries, stages, deadline)
        encode_ms = _ms(t) if any(s.dense_k for s in stages) else 0.0  # sparse: no encode

        t = time.perf_counter()
        routed = await self._strong_as_session(parts, queries, deadline)
        found = await self._search_index(
            parts, routed, fetch_ks, stages, vectors, search_deadline(deadline, budget)
        )
        search_ms = _ms(t)

        index_results = [(f.hits, f.missing) for f in found]
        fetch_ms = await self._fetch_documents(parts, queries, depths, index_results, deadline)
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
        for result, stage, cut, from_cache in zip(results, stages, truncated, cached, strict=True):
            encoded = bool(stage.dense_k)  # a sparse query is not embedded: no model, no time
            result.model = parts.encoder.model_name if encoded else ""
            result.generation = serving.generation
            result.query_truncated = cut
            result.embedding_cached = from_cache
            result.timings.encode_ms = encode_ms if encoded else 0.0
            result.timings.search_ms = search_ms
            result.timings.fetch_ms = fetch_ms
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
        self,
        parts: Bundle,
        queries: Sequence[SearchQuery],
        stages: Sequence[_Stage],
        deadline: Deadline,
    ) -> tuple[np.ndarray, list[bool], list[bool]]:
        """:meth:`_embed` of the queries that have a dense list (a sparse one is not
        encoded: its row of vectors stays zero and unused)."""
        rows = [i for i, s in enumerate(stages) if s.dense_k]
        if len(rows) == len(queries):
            return await self._embed(parts, [q.text for q in queries], deadline)
        vectors = np.zeros((len(queries), parts.encoder.dim), dtype=np.float32)
        truncated, cached = [False] * len(queries), [False] * len(queries)
        if rows:
            vecs, cut, hit = await self._embed(parts, [queries[i].text for i in rows], deadline)
            vectors[rows] = vecs
            for j, i in enumerate(rows):
                truncated[i], cached[i] = cut[j], hit[j]
        return vectors, truncated, cached

    async def _encode(self, parts: Bundle, texts: list[str], deadline: Deadline) -> Embeddings:
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

    async def _embed(
        self, parts: Bundle, texts: list[str], deadline: Deadline
    ) -> tuple[np.ndarray, list[bool], list[bool]]:
        """(vectors, truncated, from the cache) per text. With the query cache: one
        lookup for all texts, one encoder call for the distinct misses (texts with one
        normal form are encoded once), the new embeddings stored in the background. The
        cache keys on the generation's encoder (model, version, digest)."""
        cache = self.query_cache
        if cache is None:
            embedded = await self._encode(parts, texts, deadline)
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
            embedded = await self._encode(parts, miss_texts, deadline)
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
        self, parts: Bundle, queries: Sequence[SearchQuery], deadline: Deadline
    ) -> Sequence[SearchQuery]:
        """STRONG reads wait for the log tails as of now: read once for the whole request
        (one pipelined Redis round trip) and sent as a SESSION token. A tail that cannot
        be read fails the request with Unavailable: without it a STRONG read has nothing
        to promise (a shard reading its own tail would only drop out as a partial)."""
        if not any(q.consistency is Consistency.STRONG for q in queries):
            return queries
        tail = await bounded(parts.tails.tail(), deadline, "reading the log tails")
        return [
            dataclasses.replace(q, consistency=Consistency.SESSION, write_token=tail)
            if q.consistency is Consistency.STRONG
            else q
            for q in queries
        ]

    async def _fetch_documents(
        self,
        parts: Bundle,
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
        docs = await bounded(parts.documents.get_many(ids), deadline, "the document fetch")
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
        parts: Bundle,
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
            query = IndexQuery(
                vectors[rows] if stage.dense_k else None,
                stage.dense_k,
                nprobe=first.nprobe,
                filter=first.filter,
                consistency=first.consistency,
                write_token=first.write_token,
                require_complete=first.require_complete,
                texts=tuple(queries[i].text for i in rows) if stage.sparse_k else (),
                sparse_k=stage.sparse_k,
            )
            result = await parts.index.search(query, deadline.remaining())
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
            hits=hits,
            model="",
            partial=bool(missing),
            missing_shards=missing,
            timings=timings,
            rerank_skipped=bool(skipped),
            rerank_skipped_reason=skipped,
        )
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


def _not_taken(moved: GenerationMoved) -> Unavailable:
    return Unavailable(
        "the write was not taken within its deadline: the serving index generation is "
        f"switching ({moved.message}); nothing was written, write again"
    )


@dataclass
class DocumentPipeline:
    source: GenerationSource
    limits: Limits = field(default_factory=Limits)
    default_timeout_s: float = DEFAULT_TIMEOUT_S
    # called once per write refused by a moved writer gate (the gateway's counter)
    on_moved: Callable[[], None] = field(default=lambda: None)

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline.after(self.default_timeout_s if timeout is None else timeout)

    async def upsert(self, docs: Sequence[Document], timeout: float | None) -> WriteResult:
        """Encode (only what the model reads, see :mod:`services.encoder.texts`), then
        store the whole documents and log them, in the serving generation (encoded again
        with the next one's encoder when a switch moves the writes meanwhile)."""
        deadline = self._deadline(timeout)
        validation.check_documents(docs, self.limits)
        cuts = [cut_for_encoder(d.embedding_text) for d in docs]
        texts = [text for text, _ in cuts]
        encoded: tuple[str, list[DocRecord], int] | None = None  # (encoder, records, cut)

        async def write(serving: Serving, parts: Bundle) -> WriteResult:
            nonlocal encoded
            if encoded is None or encoded[0] != parts.encoder_id:
                encoded = (
                    parts.encoder_id,
                    *await self._encode(parts, docs, texts, cuts, deadline),
                )
            _, records, truncated = encoded
            token = await bounded(parts.writer.upsert(records), deadline, "the write")
            return WriteResult(token, len(docs), truncated=truncated, origin=serving.origin)

        return await self._write(write, deadline)

    async def _encode(
        self,
        parts: Bundle,
        docs: Sequence[Document],
        texts: list[str],
        cuts: list[tuple[str, bool]],
        deadline: Deadline,
    ) -> tuple[list[DocRecord], int]:
        step = max(1, parts.encoder.max_batch)
        chunks = await asyncio.gather(
            *[
                parts.encoder.encode(texts[i : i + step], "document", timeout=deadline.remaining())
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
        return records, truncated

    async def delete(self, ids: Sequence[str], timeout: float | None = None) -> WriteResult:
        deadline = self._deadline(timeout)
        validation.check_ids(ids, self.limits)

        async def write(serving: Serving, parts: Bundle) -> WriteResult:
            token, deleted, missing = await bounded(
                parts.writer.delete(ids), deadline, "the delete"
            )
            return WriteResult(token, len(deleted), not_found=tuple(missing), origin=serving.origin)

        return await self._write(write, deadline)

    async def _write(
        self, write: Callable[[Serving, Bundle], Awaitable[WriteResult]], deadline: Deadline
    ) -> WriteResult:
        """``write`` on the serving generation. When its writer gate refuses it
        (GenerationMoved: nothing written), the alias is read again and the write goes to
        the generation it names: at once when the gate names the new generation, after a
        pause while the gate is closed (a switch drains) or the alias has not moved yet
        (10 ms doubling to 200 ms). Unavailable when the deadline runs out first, or would
        before another attempt could end: an attempt cut by the deadline would be
        DEADLINE_EXCEEDED, which does not say that nothing was written."""
        serving = self.source.current()
        pause = MOVED_BACKOFF_S
        while True:
            started = time.monotonic()
            with self.source.lease(serving) as parts:
                try:
                    return await write(serving, parts)
                except GenerationMoved as exc:
                    moved = exc
            attempt_s = time.monotonic() - started
            self.on_moved()
            tried = serving.generation
            if moved.gate != CLOSED:  # the gate names the generation that takes writes now
                serving = await self._reread(moved, deadline)
            if moved.gate == CLOSED or serving.generation == tried:
                left = deadline.remaining()
                if left is not None and left <= pause + max(MOVED_MARGIN_S, 2 * attempt_s):
                    raise _not_taken(moved)
                await asyncio.sleep(pause)
                pause = min(2 * pause, MOVED_BACKOFF_MAX_S)
                serving = await self._reread(moved, deadline)

    async def _reread(self, moved: GenerationMoved, deadline: Deadline) -> Serving:
        try:
            return await bounded(self.source.refresh(), deadline, "reading the alias")
        except DeadlineExceeded:
            raise _not_taken(moved) from None

    async def get(self, doc_id: str, timeout: float | None = None) -> Document:
        deadline = self._deadline(timeout)
        validation.check_id(doc_id, self.limits)
        serving = self.source.current()
        with self.source.lease(serving) as parts:
            (doc,) = await bounded(parts.documents.get_many([doc_id]), deadline, "the read")
        if doc is None:
            raise NotFound(f"document {doc_id!r} does not exist")
        return doc
