"""The interfaces the gateway pipeline needs from the other stages.

The pipeline depends on these protocols, not on grpc, Redis or Triton; the server
wires the real implementations (Triton or in-process encoder, shard router, Redis
change log, rerank client) and the tests can wire real ones on free ports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from services.gateway.domain import Consistency, Document, FieldCondition


class Embedded(Protocol):
    @property
    def vectors(self) -> np.ndarray:
        """float32 (n, dim), L2-normalised."""
        ...

    @property
    def truncated(self) -> list[bool]:
        """Per text: whether it was cut to the model's max length."""
        ...


class QueryEncoder(Protocol):
    model_name: str
    dim: int
    max_batch: int

    async def encode(
        self,
        texts: Sequence[str],
        kind: Literal["query", "document"],
        timeout: float | None = None,
    ) -> Embedded: ...


@dataclass(frozen=True)
class IndexHit:
    doc_id: str
    score: float
    shard: int


@dataclass(frozen=True)
class IndexResult:
    hits: list[list[IndexHit]]  # per query, best first
    missing_shards: list[int]


class VectorIndex(Protocol):
    num_shards: int

    async def search(
        self,
        vectors: np.ndarray,
        k: int,
        *,
        nprobe: int,
        filter: Sequence[FieldCondition],
        consistency: Consistency,
        write_token: dict[int, str],
        timeout: float | None,
        require_complete: bool,
    ) -> IndexResult: ...


class DocumentStore(Protocol):
    async def upsert(self, docs: Sequence[Document], vectors: np.ndarray) -> dict[int, str]: ...

    async def delete(self, ids: Sequence[str]) -> tuple[dict[int, str], list[str], list[str]]:
        """Returns (write token, deleted ids, ids that did not exist)."""
        ...

    async def get_many(self, ids: Sequence[str]) -> list[Document | None]: ...

    async def tail(self) -> dict[int, str]:
        """The newest position of every shard's log (Unavailable when it cannot be read)."""
        ...


class Reranker(Protocol):
    async def rerank(
        self, query: str, candidates: Sequence[tuple[str, str]], timeout: float | None
    ) -> list[tuple[int, float]]:
        """Scores for (id, text) candidates: (candidate index, score), best first."""
        ...

    def depth_for_budget(self, budget_ms: float) -> int: ...
