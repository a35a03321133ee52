"""The reranker's request and answer (no proto, no grpc).

A candidate and a reranked hit are the shared :class:`services.common.domain.Hit`, the
same type the gateway merges, fetches documents for and answers with: a candidate is a
hit with its document (the text the model reads is ``document.embedding_text``), a
reranked hit is that hit with ``score`` the reranker's (``first_stage_score`` as it came).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.domain import Hit

MAX_CANDIDATES = 1000

__all__ = ["MAX_CANDIDATES", "Hit", "RerankQuery", "RerankResult", "candidate_text"]


def candidate_text(hit: Hit) -> str:
    """What the model reads of a candidate: "title text" ("" without a document)."""
    return hit.document.embedding_text if hit.document is not None else ""


@dataclass(frozen=True)
class RerankQuery:
    """``top_n = 0`` means all candidates; ``checkpoint`` "" the service's default model,
    else a checkpoint under its ``--checkpoint-dir`` by name."""

    query: str
    candidates: tuple[Hit, ...]
    top_n: int = 0
    checkpoint: str = ""


@dataclass(frozen=True)
class RerankResult:
    """The best ``top_n`` candidates, best first: ``hits[i]`` is the candidate at position
    ``order[i]`` of the request, its ``score`` the reranker's."""

    hits: tuple[Hit, ...]
    order: tuple[int, ...]
    model: str
