"""The gateway's search core: encode → fan-out → fetch → (rerank).

Each request is served by one index generation (docs/generations.md): the pipeline takes
its parts (encoder, shards, documents, logs) from a
:class:`~services.gateway.generations.GenerationSource` at the start of the request, and
the answer names it.

A search's first stage is dense (the query embedding), sparse (BM25 in the shards' text
indexes; the query is not encoded) or hybrid (both lists from one fan-out, each merged
over the shards by the router, then fused here by :mod:`services.common.fusion`); the
reranker reorders what that stage found.

The stages live in their own modules: the first stage in
:mod:`services.gateway.first_stage`, the query embeddings in
:mod:`services.gateway.embedding`, the rerank in :mod:`services.gateway.reranking`, the
time each gets in :mod:`services.gateway.budget`; the writes and reads of documents in
:mod:`services.gateway.document_pipeline`. This module runs a search through them.

No grpc here: the servicer converts protos to the domain objects of
:mod:`services.gateway.domain` and back, and every stage is reached through the
protocols of :mod:`services.gateway.ports`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.common.deadline import Deadline
from services.common.errors import FailedPrecondition
from services.common.fusion import RetrievalDefaults
from services.common.limits import Limits
from services.gateway import validation
from services.gateway.budget import DEFAULT_TIMEOUT_S, bounded, ms_since, search_deadline
from services.gateway.domain import Consistency, Hit, SearchQuery, SearchResult
from services.gateway.embedding import QueryEmbedder
from services.gateway.first_stage import plan_stage, search_index
from services.gateway.generation_parts import Bundle, Serving, resolve_token
from services.gateway.generations import GenerationSource
from services.gateway.metrics import GatewayMetrics
from services.gateway.ports import Reranker
from services.gateway.query_cache import QueryEmbeddingCache
from services.gateway.reranking import finish, rerank_plan
from services.generations.serving_latency import LatencyWindow
from services.process.hold import Holder
from services.telemetry import tracing

log = logging.getLogger(__name__)


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
    # services.rpc.admission.Admission.pressure. Rerank is shed by it.
    pressure: Callable[[], float] = field(default=lambda: 0.0)
    # Query embeddings kept in Redis (--query-cache); None: every query is encoded.
    query_cache: QueryEmbeddingCache | None = None
    # What a query that names no mode or fusion gets (--default-mode, --fusion, ...) on a
    # generation whose record has no retrieval setting; one that has one gets its fusion
    # and candidates (the mode stays this one's): :meth:`retrieval_on`.
    retrieval: RetrievalDefaults = field(default_factory=RetrievalDefaults)
    # each answered request's total time (the gateway reports it for a rollout's pacing:
    # services/gateway/latency_report.py)
    latency: LatencyWindow = field(default_factory=LatencyWindow)
    # a rollout's processes paused while a search runs (--hold-file); None: none
    hold: Holder | None = None

    def retrieval_on(self, serving: Serving) -> RetrievalDefaults:
        """What a query that names no fusion gets on ``serving``'s generation: its
        retrieval setting's fusion and candidates, else the gateway's flags."""
        setting = serving.setting
        return self.retrieval if setting is None else setting.defaults(self.retrieval.mode)

    @property
    def embedder(self) -> QueryEmbedder:
        """The query embeddings, with this pipeline's cache and encode metrics."""
        return QueryEmbedder(self.metrics, self.query_cache)

    async def search(self, query: SearchQuery, timeout: float | None) -> SearchResult:
        return (await self.search_batch([query], timeout, batch=False))[0]

    async def search_batch(
        self, queries: Sequence[SearchQuery], timeout: float | None, batch: bool = True
    ) -> list[SearchResult]:
        """``timeout``: the client's deadline in seconds; None (the client set none) takes
        ``default_timeout_s``: every wait below is bounded by what is left of it."""
        if self.hold is None:
            return await self._search_batch(queries, timeout, batch)
        with self.hold.searching():
            return await self._search_batch(queries, timeout, batch)

    async def _search_batch(
        self, queries: Sequence[SearchQuery], timeout: float | None, batch: bool
    ) -> list[SearchResult]:
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
        total_ms = ms_since(start)
        for result in results:
            result.timings.total_ms = total_ms
        self.latency.record(total_ms)
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

        plans = [
            rerank_plan(q, deadline, self.reranker, self.pressure, serving.setting) for q in queries
        ]
        depths = [plan.depth for plan in plans]
        fetch_ks = [max(q.k, d) for q, d in zip(queries, depths, strict=True)]
        retrieval = self.retrieval_on(serving)
        stages = [plan_stage(q, fk, retrieval) for q, fk in zip(queries, fetch_ks, strict=True)]

        t = time.perf_counter()
        with tracing.span("encode") as span:
            vectors, truncated, cached = await self.embedder.embed_dense(
                parts, queries, stages, deadline
            )
            if span:
                span.set_attribute("gtr.cached", sum(cached))
        encode_ms = ms_since(t) if any(s.dense_k for s in stages) else 0.0  # sparse: no encode

        # No span of its own: the router's wave span (or its shard searches) already is
        # the index search, and a span costs ~15 us of CPU (docs/tracing.md "Cost").
        tracing.annotate({"gtr.generation": serving.generation, "gtr.queries": len(queries)})
        t = time.perf_counter()
        routed = await self._strong_as_session(parts, queries, deadline)
        found = await search_index(
            parts, routed, fetch_ks, stages, vectors, search_deadline(deadline, budget)
        )
        search_ms = ms_since(t)

        index_results = [(f.hits, f.missing) for f in found]
        fetch_ms = await self._fetch_documents(parts, queries, depths, index_results, deadline)
        results = await asyncio.gather(
            *[
                finish(q, plan, hits, missing, deadline, self.reranker)
                for q, plan, (hits, missing) in zip(queries, plans, index_results, strict=True)
            ]
        )
        for result, stage, f in zip(results, stages, found, strict=True):
            result.mode = stage.mode
            result.fusion = stage.fusion
            result.fusion_candidates = stage.dense_k if stage.fusion is not None else 0
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
        with tracing.span("document fetch", tracing.CLIENT) as span:
            if span:
                span.set_attributes({"db.system": "redis", "gtr.documents": len(ids)})
            docs = await bounded(parts.documents.get_many(ids), deadline, "the document fetch")
        fetch_ms = ms_since(t)
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
