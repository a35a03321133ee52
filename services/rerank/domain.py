"""The reranker's domain objects (no proto, no grpc)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_CANDIDATES = 1000


@dataclass(frozen=True)
class Candidate:
    id: str
    text: str


@dataclass(frozen=True)
class RerankQuery:
    """``top_n = 0`` means all candidates."""

    query: str
    candidates: tuple[Candidate, ...]
    top_n: int = 0


@dataclass(frozen=True)
class RerankedHit:
    id: str
    score: float
    index: int  # position of the candidate in the request


@dataclass(frozen=True)
class RerankResult:
    hits: tuple[RerankedHit, ...]
    model: str
