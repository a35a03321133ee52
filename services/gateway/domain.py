"""What the gateway works with, free of protobuf and grpc: a search request and its
result, a write's result. Documents, hits, filters, consistency and write tokens are the
shared words of :mod:`services.common.domain`."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.domain import Consistency, Document, FieldCondition, Hit, TokenOrigin
from services.common.fusion import Fusion, Mode

__all__ = [
    "Consistency",
    "Document",
    "FieldCondition",
    "Hit",
    "SearchQuery",
    "SearchResult",
    "Timings",
    "TokenOrigin",
    "WriteResult",
]


@dataclass(frozen=True)
class SearchQuery:
    text: str
    k: int
    filter: tuple[FieldCondition, ...] = ()
    consistency: Consistency = Consistency.EVENTUAL
    write_token: dict[int, str] = field(default_factory=dict)
    # the generation and alias epoch of the write token (docs/generations.md)
    token_origin: TokenOrigin = field(default_factory=TokenOrigin)
    require_complete: bool = False
    rerank: bool = False
    rerank_depth: int = 0  # 0 = choose by the remaining budget
    nprobe: int = 0  # 0 = the shards' default
    ids_only: bool = False
    mode: Mode | None = None  # None: the gateway's default mode
    fusion: Fusion | None = None  # hybrid; None: the gateway's default fusion
    candidates: int = 0  # hybrid: hits taken from each list; 0 = the gateway's choice


@dataclass
class Timings:
    encode_ms: float = 0.0
    search_ms: float = 0.0
    fetch_ms: float = 0.0
    rerank_ms: float = 0.0
    total_ms: float = 0.0


@dataclass
class SearchResult:
    hits: list[Hit]
    model: str
    partial: bool = False
    missing_shards: list[int] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    query_truncated: bool = False
    reranked: bool = False
    rerank_depth: int = 0
    rerank_skipped: bool = False  # asked for, but no measured depth fit the time left
    rerank_skipped_reason: str = ""
    embedding_cached: bool = False  # the query embedding came from the query cache
    mode: Mode = Mode.DENSE  # the first stage that answered
    fusion: Fusion | None = None  # the fusion of a hybrid answer
    fusion_candidates: int = 0  # hits taken from each list before fusing (hybrid)
    sparse_missing_shards: list[int] = field(default_factory=list)  # no sparse list
    generation: str = ""  # the index generation that answered (docs/generations.md)


@dataclass(frozen=True)
class WriteResult:
    write_token: dict[int, str]
    count: int
    not_found: tuple[str, ...] = ()
    truncated: int = 0
    origin: TokenOrigin = field(
        default_factory=TokenOrigin
    )  # the generation and epoch that took the write
