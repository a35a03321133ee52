"""Proto ↔ domain conversions of RerankService (the only place both meet)."""

from __future__ import annotations

from retrieval.v1 import rerank_pb2
from services.rerank.domain import Candidate, RerankedHit, RerankQuery, RerankResult


def query_from_pb(request: rerank_pb2.RerankRequest) -> RerankQuery:
    return RerankQuery(
        query=request.query,
        candidates=tuple(Candidate(c.id, c.text) for c in request.candidates),
        top_n=int(request.top_n),
    )


def query_to_pb(query: RerankQuery) -> rerank_pb2.RerankRequest:
    return rerank_pb2.RerankRequest(
        query=query.query,
        candidates=[rerank_pb2.RerankCandidate(id=c.id, text=c.text) for c in query.candidates],
        top_n=query.top_n,
    )


def result_to_pb(result: RerankResult) -> rerank_pb2.RerankResponse:
    return rerank_pb2.RerankResponse(
        hits=[rerank_pb2.RerankedHit(id=h.id, score=h.score, index=h.index) for h in result.hits],
        model=result.model,
    )


def result_from_pb(response: rerank_pb2.RerankResponse) -> RerankResult:
    return RerankResult(
        hits=tuple(RerankedHit(h.id, float(h.score), int(h.index)) for h in response.hits),
        model=response.model,
    )
