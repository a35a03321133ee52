"""Protobuf ↔ domain conversions for the public API (round-trip tested)."""

from __future__ import annotations

from retrieval.v1 import documents_pb2, search_pb2
from services.common.errors import InvalidArgument
from services.common.fusion import DEFAULT_RRF_K, Fusion, Method, Mode
from services.gateway.domain import (
    Document,
    SearchQuery,
    SearchResult,
    WriteResult,
)
from services.rpc.convert import (
    consistency_from_pb,
    consistency_to_pb,
    filter_from_pb,
    filter_to_pb,
    token_from_pb,
    token_origin_from_pb,
    token_to_pb,
)

__all__ = ["token_from_pb", "token_origin_from_pb", "token_to_pb"]

_MODES = {
    search_pb2.RETRIEVAL_MODE_DENSE: Mode.DENSE,
    search_pb2.RETRIEVAL_MODE_SPARSE: Mode.SPARSE,
    search_pb2.RETRIEVAL_MODE_HYBRID: Mode.HYBRID,
}
_MODES_PB = {mode: number for number, mode in _MODES.items()}
_METHODS = {
    search_pb2.FUSION_METHOD_RRF: Method.RRF,
    search_pb2.FUSION_METHOD_WEIGHTED: Method.WEIGHTED,
}
_METHODS_PB = {method: number for number, method in _METHODS.items()}


def mode_from_pb(value: int) -> Mode | None:
    """None for UNSPECIFIED (the gateway's default); InvalidArgument for a number this
    gateway does not know."""
    if value == search_pb2.RETRIEVAL_MODE_UNSPECIFIED:
        return None
    if value not in _MODES:
        raise InvalidArgument(f"mode: unknown retrieval mode {value}")
    return _MODES[value]  # type: ignore[index]


def fusion_from_pb(req: search_pb2.SearchRequest) -> Fusion | None:
    """The request's fusion (None: unset, the gateway's default); InvalidArgument for
    parameters out of range."""
    if not req.HasField("fusion"):
        return None
    f = req.fusion
    if (
        f.method == search_pb2.FUSION_METHOD_UNSPECIFIED
        and not f.rrf_k
        and not f.HasField("dense_weight")
    ):
        return None  # only `candidates` set
    if f.method != search_pb2.FUSION_METHOD_UNSPECIFIED and f.method not in _METHODS:
        raise InvalidArgument(f"fusion method: unknown method {f.method}")
    method = _METHODS.get(f.method, Method.WEIGHTED if f.HasField("dense_weight") else Method.RRF)
    return Fusion(
        method,
        rrf_k=f.rrf_k or DEFAULT_RRF_K,
        dense_weight=f.dense_weight if f.HasField("dense_weight") else 0.5,
    )


def fusion_to_pb(f: Fusion, candidates: int = 0) -> search_pb2.Fusion:
    return search_pb2.Fusion(
        method=_METHODS_PB[f.method],  # type: ignore[arg-type]
        rrf_k=f.rrf_k,
        dense_weight=f.dense_weight,
        candidates=candidates,
    )


def query_from_pb(req: search_pb2.SearchRequest) -> SearchQuery:
    return SearchQuery(
        text=req.query,
        k=req.k,
        filter=filter_from_pb(req.filter),
        consistency=consistency_from_pb(req.consistency),
        write_token=token_from_pb(req.write_token),
        token_origin=token_origin_from_pb(req.write_token),
        require_complete=req.require_complete,
        rerank=req.rerank.enabled,
        rerank_depth=req.rerank.depth,
        nprobe=req.nprobe,
        ids_only=req.ids_only,
        mode=mode_from_pb(req.mode),
        fusion=fusion_from_pb(req),
        candidates=req.fusion.candidates,
    )


def query_to_pb(q: SearchQuery) -> search_pb2.SearchRequest:
    return search_pb2.SearchRequest(
        query=q.text,
        k=q.k,
        filter=filter_to_pb(q.filter),
        consistency=consistency_to_pb(q.consistency),
        write_token=token_to_pb(q.write_token, q.token_origin),
        require_complete=q.require_complete,
        rerank=search_pb2.RerankOptions(enabled=q.rerank, depth=q.rerank_depth),
        nprobe=q.nprobe,
        ids_only=q.ids_only,
        mode=_MODES_PB[q.mode] if q.mode is not None else search_pb2.RETRIEVAL_MODE_UNSPECIFIED,  # type: ignore[arg-type]
        fusion=(
            fusion_to_pb(q.fusion, q.candidates)
            if q.fusion is not None
            else search_pb2.Fusion(candidates=q.candidates)
            if q.candidates
            else None
        ),
    )


def result_to_pb(r: SearchResult) -> search_pb2.SearchResponse:
    hits = []
    for h in r.hits:
        hit = search_pb2.Hit(
            id=h.id,
            score=h.score,
            first_stage_score=h.first_stage_score,
            shard=h.shard,
            dense_rank=h.dense_rank,
            sparse_rank=h.sparse_rank,
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
        mode=_MODES_PB[r.mode],  # type: ignore[arg-type]
        fusion=fusion_to_pb(r.fusion, r.fusion_candidates) if r.fusion is not None else None,
        sparse_missing_shards=r.sparse_missing_shards,
        generation=r.generation,
    )


def document_from_pb(d: documents_pb2.Document) -> Document:
    return Document(id=d.id, text=d.text, title=d.title, metadata=dict(d.metadata))


def document_to_pb(d: Document) -> documents_pb2.Document:
    return documents_pb2.Document(id=d.id, title=d.title, text=d.text, metadata=d.metadata)


def upsert_result_to_pb(r: WriteResult) -> documents_pb2.UpsertResponse:
    return documents_pb2.UpsertResponse(
        write_token=token_to_pb(r.write_token, r.origin), upserted=r.count, truncated=r.truncated
    )


def delete_result_to_pb(r: WriteResult) -> documents_pb2.DeleteResponse:
    return documents_pb2.DeleteResponse(
        write_token=token_to_pb(r.write_token, r.origin),
        deleted=r.count,
        not_found=list(r.not_found),
    )
