"""The interfaces the gateway pipeline needs from the other stages.

The pipeline depends on these protocols, not on grpc, Redis or Triton. The server wires
the real implementations, which speak the shared words of :mod:`services.common.domain`
(and a search of the index is the index's own :class:`IndexQuery`) directly (no
adapters): the index's :class:`~services.index.client.router.ShardRouter`, the
change log's :class:`~services.index.client.writer.ChangeLogWriter` (documents and their
log entries), :class:`~services.index.client.documents.DocumentReader` (the stored
documents), :class:`~services.index.client.tails.LogTailReader` (the logs' newest
positions), the :class:`~services.encoder.base.Encoder` (Triton or in-process) and the
rerank client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from services.common.domain import Document, Hit, IndexResult, WriteToken
from services.encoder.base import Encoder
from services.index.changelog import TargetVectors
from services.index.client.writer import DocRecord
from services.index.core.query import IndexQuery

__all__ = [
    "DocRecord",
    "DocumentStore",
    "DocumentWriter",
    "Encoder",
    "IndexQuery",
    "LogTails",
    "Reranker",
    "TargetVectors",
    "VectorIndex",
]


class VectorIndex(Protocol):
    num_shards: int

    async def search(self, query: IndexQuery, timeout: float | None = None) -> IndexResult:
        """Dense top-``k`` of each vector and, with ``texts`` / ``sparse_k``, the BM25
        lists (``IndexResult.sparse``); ``vectors`` None and ``k`` 0: sparse only. The
        search is an :class:`IndexQuery`, the one type the router takes too."""
        ...

    async def close(self) -> None: ...


class DocumentWriter(Protocol):
    """Stores documents and logs them to their shards, in one transaction per write."""

    async def upsert(
        self, records: Sequence[DocRecord], target: TargetVectors | None = None
    ) -> WriteToken:
        """``target``: the records' vectors by a rollout target's encoder, logged beside
        theirs (the dual write, :mod:`services.gateway.dual_write`)."""
        ...

    async def keep_late_vectors(
        self, token: WriteToken, ids: Sequence[str], target: str, vectors: np.ndarray
    ) -> None:
        """A dual encode's rows that ended after the upsert ``token`` acknowledged, kept
        for rollout target ``target``'s catch-up (:mod:`services.index.client.late_vectors`)."""
        ...

    async def delete(self, ids: Sequence[str]) -> tuple[WriteToken, list[str], list[str]]:
        """Returns (write token, deleted ids, ids that did not exist)."""
        ...


class DocumentStore(Protocol):
    async def get_many(self, ids: Sequence[str]) -> list[Document | None]:
        """The stored documents of ``ids``, None where one does not exist."""
        ...


class LogTails(Protocol):
    async def tail(self) -> WriteToken:
        """The newest position of every shard's log (Unavailable when it cannot be read)."""
        ...


class Reranker(Protocol):
    async def rerank(
        self,
        query: str,
        candidates: Sequence[Hit],
        timeout: float | None,
        checkpoint: str = "",
    ) -> list[Hit]:
        """The candidates (hits with their documents) best first, each with ``score`` the
        reranker's and ``first_stage_score`` as it came; scored by the rerank service's
        ``checkpoint`` ("" = its default model; NotFound when it has no such one)."""
        ...

    def depth_for_budget(self, budget_ms: float) -> int: ...
