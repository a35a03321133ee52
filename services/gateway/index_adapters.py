"""The index package's router and change-log writer, seen through the gateway's ports.

The gateway pipeline speaks its own domain types (``services.gateway.domain``); the
index package has its own. These adapters are the only place that translates.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.gateway.domain import Consistency, Document, FieldCondition
from services.gateway.ports import IndexHit, IndexResult
from services.index.changelog import ChangeLogWriter, DocRecord
from services.index.query import Consistency as IndexConsistency
from services.index.router import ShardRouter


class RouterIndex:
    """``ports.VectorIndex`` over :class:`ShardRouter` (fan-out, coalescing, failover)."""

    def __init__(self, router: ShardRouter) -> None:
        self._router = router
        self.num_shards = router.num_shards

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
    ) -> IndexResult:
        result = await self._router.search(
            vectors,
            k,
            nprobe=nprobe,
            filter=[(c.key, list(c.any_of)) for c in filter],
            consistency=IndexConsistency(consistency.value),
            write_token=write_token or None,
            timeout=timeout,
            require_complete=require_complete,
        )
        return IndexResult(
            [[IndexHit(h.doc_id, h.score, h.shard) for h in row] for row in result.hits],
            list(result.missing_shards),
        )

    async def close(self) -> None:
        await self._router.close()


class LogStore:
    """``ports.DocumentStore`` over :class:`ChangeLogWriter` (documents + logs in Redis)."""

    def __init__(self, writer: ChangeLogWriter) -> None:
        self._writer = writer

    async def upsert(self, docs: Sequence[Document], vectors: np.ndarray) -> dict[int, str]:
        records = [
            DocRecord(d.id, vectors[i], d.title, d.text, dict(d.metadata))
            for i, d in enumerate(docs)
        ]
        return dict(await self._writer.upsert(records))

    async def delete(self, ids: Sequence[str]) -> tuple[dict[int, str], list[str], list[str]]:
        token, deleted, missing = await self._writer.delete(list(ids))
        return dict(token), list(deleted), list(missing)

    async def get_many(self, ids: Sequence[str]) -> list[Document | None]:
        stored = await self._writer.get_many(ids)
        return [
            None if s is None else Document(s.doc_id, s.text, s.title, dict(s.metadata))
            for s in stored
        ]

    async def tail(self) -> dict[int, str]:
        return dict(await self._writer.tail())

    async def close(self) -> None:
        await self._writer.close()
