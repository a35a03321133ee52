"""Protobuf ↔ domain conversions for the public API (round-trip tested)."""

from __future__ import annotations

from retrieval.v1 import documents_pb2, search_pb2
from services.common.convert import (
    consistency_from_pb,
    consistency_to_pb,
    filter_from_pb,
    filter_to_pb,
    token_from_pb,
    token_to_pb,
)
from services.gateway.domain import (
    Document,
    SearchQuery,
    SearchResult,
    WriteResult,
)

__all__ = ["token_from_pb", "token_to_pb"]


def query_from_pb(req: search_pb2.SearchRequest) -> SearchQuery:
    return SearchQuery(
        text=req.query,
        k=req.k,
        filter=filter_from_pb(req.filter),
        consistency=consistency_from_pb(req.consistency),
        write_token=token_from_pb(req.write_token),
        require_complete=req.require_complete,
        rerank=req.rerank.enabled,
        rerank_depth=req.rerank.depth,
        nprobe=req.nprobe,
        ids_only=req.ids_only,
    )


def query_to_pb(q: SearchQuery) -> search_pb2.SearchRequest:
    return search_pb2.SearchRequest(
        query=q.text,
        k=q.k,
        filter=filter_to_pb(q.filter),
        consistency=consistency_to_pb(q.consistency),
        write_token=token_to_pb(q.write_token),
        require_complete=q.require_complete,
        rerank=search_pb2.RerankOptions(enabled=q.rerank, depth=q.rerank_depth),
        nprobe=q.nprobe,
        ids_only=q.ids_only,
    )


def result_to_pb(r: SearchResult) -> search_pb2.SearchResponse:
    hits = []
    for h in r.hits:
        hit = search_pb2.Hit(
            id=h.id, score=h.score, first_stage_score=h.first_stage_score, shard=h.shard
        )
        if h.document is not None:
            hit.title = h.document.title
            hit.text = h.document.text
            hit.metadata.update(h.document.metadata)
        hits.append(hit)
    t = r.timings
    return search_pb2.SearchResponse(
        hits=hits,
        partial=r.partial,
        missing_shards=r.missing_shards,
        model=r.model,
        timings=search_pb2.StageTimings(
            encode_ms=t.encode_ms,
            search_ms=t.search_ms,
            fetch_ms=t.fetch_ms,
            rerank_ms=t.rerank_ms,
            total_ms=t.total_ms,
        ),
        query_truncated=r.query_truncated,
        reranked=r.reranked,
        rerank_depth=r.rerank_depth,
        rerank_skipped=r.rerank_skipped,
        rerank_skipped_reason=r.rerank_skipped_reason,
        embedding_cached=r.embedding_cached,
    )


def document_from_pb(d: documents_pb2.Document) -> Document:
    return Document(id=d.id, text=d.text, title=d.title, metadata=dict(d.metadata))


def document_to_pb(d: Document) -> documents_pb2.Document:
    return documents_pb2.Document(id=d.id, title=d.title, text=d.text, metadata=d.metadata)


def upsert_result_to_pb(r: WriteResult) -> documents_pb2.UpsertResponse:
    return documents_pb2.UpsertResponse(
        write_token=token_to_pb(r.write_token), upserted=r.count, truncated=r.truncated
    )


def delete_result_to_pb(r: WriteResult) -> documents_pb2.DeleteResponse:
    return documents_pb2.DeleteResponse(
        write_token=token_to_pb(r.write_token), deleted=r.count, not_found=list(r.not_found)
    )
