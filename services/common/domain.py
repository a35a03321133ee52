"""The words the gateway, the index's router and the reranker share: one type per
concept, no grpc, no numpy.

A hit takes five forms from FAISS to the client (seven with the rerank), each the one
type of its stage (docs/architecture.md, "Follow one search"): FAISS's arrays and the
shard's grid (:class:`services.index.core.query.TopK`) inside the shard, the grid on the
internal wire (``ShardSearchResponse``), :class:`Hit` from the router's merge to the
gateway's response, and the public ``Hit`` message. A reranked search sends the hits as
they are (``RerankCandidate``) and gets them back as ``RerankedHit`` messages: the rerank
service's candidates and reranked hits are :class:`Hit` too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

# A write token: for every shard a write touched, the stream ID ("ms-seq") of its log
# entry (see services.common.positions for comparing and merging them).
WriteToken = dict[int, str]


@dataclass(frozen=True)
class TokenOrigin:
    """Where a write token's positions are (issue #24, docs/generations.md): the index
    generation whose logs hold them and the alias epoch the write was taken in. The
    default ("", 0) is a token built from positions alone (or from before generations):
    generation g1's, older than every switch."""

    generation: str = ""
    epoch: int = 0


class Consistency(enum.Enum):
    EVENTUAL = "eventual"
    SESSION = "session"
    STRONG = "strong"


class FieldCondition(NamedTuple):
    """A filter condition: the document's metadata ``key`` has one of ``any_of``.
    A tuple, so that ``for key, values in conditions`` reads it."""

    key: str
    any_of: tuple[str, ...]


@dataclass(frozen=True)
class Document:
    """A stored document; ``version`` counts its writes (0 for one not stored yet)."""

    id: str
    text: str
    title: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    version: int = 0

    @property
    def embedding_text(self) -> str:
        """What the encoder sees: "title text" (the BEIR convention)."""
        return f"{self.title} {self.text}" if self.title else self.text


@dataclass(slots=True)
class Hit:
    """One search hit, from the router's merge to the gateway's response; also a rerank
    candidate and the reranked hit (:mod:`services.rerank.domain`).

    ``score`` is the final score (the reranker's when it ran), ``first_stage_score``
    the index's (the fused score in a hybrid search); ``document`` is attached by the
    gateway when the response or the reranker needs it. ``dense_rank`` / ``sparse_rank``:
    the hit's 1-based rank in the merged dense and sparse lists of a hybrid or sparse
    search (0: not in that list, or a dense search).
    """

    id: str
    score: float
    shard: int
    first_stage_score: float
    document: Document | None = None
    dense_rank: int = 0
    sparse_rank: int = 0


@dataclass
class IndexResult:
    """The router's answer: per query its hits, best first; shards that did not answer.

    ``sparse``: per query the merged BM25 hits, when the search asked for them (None
    otherwise); ``sparse_missing_shards``: shards that answered without a sparse list
    (their replica has no text index)."""

    hits: list[list[Hit]]
    missing_shards: list[int]
    sparse: list[list[Hit]] | None = None
    sparse_missing_shards: list[int] = field(default_factory=list)
