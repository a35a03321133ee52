"""The SDK's types ↔ the wire contract's messages (``retrieval.v1``), both directions
where the SDK sends a type and reads it back (documents, write tokens, fusion), one
direction otherwise (a query is only sent, a result only read). Round-trip tested."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gtr_client.types import (
    Consistency,
    DeleteResult,
    Document,
    Fusion,
    FusionMethod,
    Hit,
    Mode,
    Query,
    SearchResult,
    StageTimings,
    UpsertResult,
    WriteToken,
)
from retrieval.v1 import common_pb2, documents_pb2, search_pb2

_MODE_PB = {
    Mode.DENSE: search_pb2.RETRIEVAL_MODE_DENSE,
    Mode.SPARSE: search_pb2.RETRIEVAL_MODE_SPARSE,
    Mode.HYBRID: search_pb2.RETRIEVAL_MODE_HYBRID,
}
_MODE = {number: mode for mode, number in _MODE_PB.items()}
_METHOD_PB = {
    FusionMethod.RRF: search_pb2.FUSION_METHOD_RRF,
    FusionMethod.WEIGHTED: search_pb2.FUSION_METHOD_WEIGHTED,
}
_METHOD = {number: method for method, number in _METHOD_PB.items()}
_CONSISTENCY_PB = {
    Consistency.EVENTUAL: common_pb2.CONSISTENCY_EVENTUAL,
    Consistency.SESSION: common_pb2.CONSISTENCY_SESSION,
    Consistency.STRONG: common_pb2.CONSISTENCY_STRONG,
}


# --- write tokens ---------------------------------------------------------------------


def token_to_pb(token: WriteToken) -> common_pb2.WriteToken:
    return common_pb2.WriteToken(
        positions=[
            common_pb2.ShardPosition(shard=shard, position=position)
            for shard, position in sorted(token.positions.items())
        ],
        generation=token.generation,
        epoch=token.epoch,
    )


def token_from_pb(pb: common_pb2.WriteToken) -> WriteToken:
    return WriteToken(
        {p.shard: p.position for p in pb.positions}, generation=pb.generation, epoch=pb.epoch
    )


# --- documents ------------------------------------------------------------------------


def document_to_pb(doc: Document | Mapping[str, Any]) -> documents_pb2.Document:
    """A :class:`Document`, or a mapping with its fields (``id``, ``text``, optional
    ``title`` and ``metadata``; a BEIR row's ``_id`` is taken for ``id``)."""
    if isinstance(doc, Document):
        return documents_pb2.Document(
            id=doc.id, title=doc.title, text=doc.text, metadata=dict(doc.metadata)
        )
    unknown = set(doc) - {"id", "_id", "title", "text", "metadata"}
    if unknown:
        raise TypeError(f"document fields: unknown {sorted(unknown)}")
    return documents_pb2.Document(
        id=str(doc.get("id", doc.get("_id", ""))),
        title=str(doc.get("title") or ""),
        text=str(doc.get("text") or ""),
        metadata={str(k): str(v) for k, v in (doc.get("metadata") or {}).items()},
    )


def document_from_pb(pb: documents_pb2.Document) -> Document:
    return Document(id=pb.id, text=pb.text, title=pb.title, metadata=dict(pb.metadata))


def upsert_result(pb: documents_pb2.UpsertResponse) -> UpsertResult:
    return UpsertResult(pb.upserted, pb.truncated, token_from_pb(pb.write_token))


def delete_result(pb: documents_pb2.DeleteResponse) -> DeleteResult:
    return DeleteResult(pb.deleted, tuple(pb.not_found), token_from_pb(pb.write_token))


# --- searches -------------------------------------------------------------------------


def fusion_to_pb(fusion: Fusion) -> search_pb2.Fusion:
    pb = search_pb2.Fusion(rrf_k=fusion.rrf_k, candidates=fusion.candidates)
    if fusion.method is not None:
        pb.method = _METHOD_PB[FusionMethod(fusion.method)]
    if fusion.dense_weight is not None:
        pb.dense_weight = fusion.dense_weight
    return pb


def fusion_from_pb(pb: search_pb2.Fusion) -> Fusion:
    return Fusion(
        method=_METHOD.get(pb.method),
        rrf_k=pb.rrf_k,
        dense_weight=pb.dense_weight if pb.HasField("dense_weight") else None,
        candidates=pb.candidates,
    )


def filter_to_pb(conditions: Mapping[str, str | Sequence[str]]) -> common_pb2.Filter:
    """Every key must match one of its values (a string is one value)."""
    return common_pb2.Filter(
        must=[
            common_pb2.FieldCondition(
                key=key, any_of=[values] if isinstance(values, str) else list(values)
            )
            for key, values in conditions.items()
        ]
    )


def search_request(query: Query) -> search_pb2.SearchRequest:
    """The request of ``query``. A ``write_token`` without a consistency asks SESSION."""
    consistency = query.consistency
    if consistency is None and query.write_token is not None:
        consistency = Consistency.SESSION
    pb = search_pb2.SearchRequest(
        query=query.text,
        k=query.k,
        require_complete=query.require_complete,
        nprobe=query.nprobe,
        ids_only=query.ids_only,
    )
    if consistency is not None:
        pb.consistency = _CONSISTENCY_PB[Consistency(consistency)]
    if query.write_token is not None:
        pb.write_token.CopyFrom(token_to_pb(query.write_token))
    if query.filter:
        pb.filter.CopyFrom(filter_to_pb(query.filter))
    if query.rerank or query.rerank_depth:
        pb.rerank.CopyFrom(search_pb2.RerankOptions(enabled=query.rerank, depth=query.rerank_depth))
    if query.mode is not None:
        pb.mode = _MODE_PB[Mode(query.mode)]
    if query.fusion is not None:
        pb.fusion.CopyFrom(fusion_to_pb(query.fusion))
    return pb


def _rank(value: int) -> int | None:
    return value or None


def hit_from_pb(pb: search_pb2.Hit) -> Hit:
    return Hit(
        id=pb.id,
        score=pb.score,
        first_stage_score=pb.first_stage_score,
        title=pb.title,
        text=pb.text,
        metadata=dict(pb.metadata),
        shard=pb.shard,
        dense_rank=_rank(pb.dense_rank),
        sparse_rank=_rank(pb.sparse_rank),
    )


def search_result(pb: search_pb2.SearchResponse) -> SearchResult:
    t = pb.timings
    return SearchResult(
        hits=tuple(hit_from_pb(h) for h in pb.hits),
        partial=pb.partial,
        missing_shards=tuple(pb.missing_shards),
        sparse_missing_shards=tuple(pb.sparse_missing_shards),
        model=pb.model or None,
        generation=pb.generation,
        mode=_MODE.get(pb.mode),
        fusion=fusion_from_pb(pb.fusion) if pb.HasField("fusion") else None,
        timings=StageTimings(t.encode_ms, t.search_ms, t.fetch_ms, t.rerank_ms, t.total_ms),
        query_truncated=pb.query_truncated,
        reranked=pb.reranked,
        rerank_depth=pb.rerank_depth,
        rerank_skipped_reason=(pb.rerank_skipped_reason or "not reranked")
        if pb.rerank_skipped
        else None,
        embedding_cached=pb.embedding_cached,
    )
