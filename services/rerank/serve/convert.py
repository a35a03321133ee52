"""Proto ↔ domain conversions of RerankService (the only place both meet).

Both sides speak :class:`services.common.domain.Hit`: a candidate travels as a
``RerankCandidate`` (the hit's id, shard, first-stage score and the text the model reads)
and comes back as a ``RerankedHit`` (id, the reranker's score, its position in the
request), which the caller turns back into its own hit with the new score.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from retrieval.v1 import rerank_pb2
from services.common.domain import Document, Hit
from services.common.errors import Unavailable
from services.rerank.domain import RerankQuery, RerankResult, candidate_text


def query_from_pb(request: rerank_pb2.RerankRequest) -> RerankQuery:
    return RerankQuery(
        query=request.query,
        candidates=tuple(
            Hit(c.id, c.first_stage_score, c.shard, c.first_stage_score, Document(c.id, c.text))
            for c in request.candidates
        ),
        top_n=int(request.top_n),
        checkpoint=request.checkpoint,
    )


def query_to_pb(query: RerankQuery) -> rerank_pb2.RerankRequest:
    return rerank_pb2.RerankRequest(
        query=query.query,
        candidates=[
            rerank_pb2.RerankCandidate(
                id=h.id,
                text=candidate_text(h),
                first_stage_score=h.first_stage_score,
                shard=h.shard,
            )
            for h in query.candidates
        ],
        top_n=query.top_n,
        checkpoint=query.checkpoint,
    )


def result_to_pb(result: RerankResult) -> rerank_pb2.RerankResponse:
    return rerank_pb2.RerankResponse(
        hits=[
            rerank_pb2.RerankedHit(id=h.id, score=h.score, index=i)
            for h, i in zip(result.hits, result.order, strict=True)
        ],
        model=result.model,
    )


def result_from_pb(response: rerank_pb2.RerankResponse, candidates: Sequence[Hit]) -> RerankResult:
    """The caller's own ``candidates``, reordered, with the reranker's scores; Unavailable
    when an answer names a position or id the request did not have (a broken server)."""
    hits = []
    for h in response.hits:
        if not h.index < len(candidates) or candidates[h.index].id != h.id:
            raise Unavailable(
                f"rerank: malformed answer (hit {h.id!r} at position {h.index} of "
                f"{len(candidates)} candidates)"
            )
        hits.append(dataclasses.replace(candidates[h.index], score=float(h.score)))
    return RerankResult(tuple(hits), tuple(int(h.index) for h in response.hits), response.model)
