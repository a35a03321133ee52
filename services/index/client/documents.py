"""The stored documents, as the gateway reads them (what a search's hits and Get show).

One pipelined round trip per call (per cluster node) through the shared
:class:`~services.index.client.connection.StoreConnection`; written by
:class:`~services.index.client.writer.ChangeLogWriter` (the ``doc:{s}:<id>`` hashes,
:mod:`services.index.keys`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from services.common.domain import Document
from services.index.client.connection import StoreConnection
from services.index.keys import Layout

STORED_FIELDS = ("title", "text", "meta", "ver")


class DocumentReader:
    """Reads documents by id (the gateway's :class:`~services.gateway.ports.DocumentStore`)
    from the documents of ``layout`` (default: the connection's, the base layout); every
    generation of a layout shares its documents (docs/generations.md)."""

    def __init__(self, connection: StoreConnection, layout: Layout | None = None) -> None:
        self.connection = connection
        self.layout = layout if layout is not None else connection.layout()

    async def get(self, doc_id: str) -> Document | None:
        (doc,) = await self.get_many([doc_id])
        return doc

    async def get_many(self, ids: Sequence[str]) -> list[Document | None]:
        """The stored documents of ``ids`` (None where one does not exist), in one
        pipelined round trip (per cluster node): a search fetches all of its hits at once
        instead of one request (and one pooled connection) per hit."""
        if not ids:
            return []
        keys = self.layout

        async def read() -> list[Any]:
            async with self.connection.redis.pipeline(transaction=False) as pipe:
                for doc_id in ids:
                    pipe.hmget(keys.doc(doc_id), *STORED_FIELDS)
                return list(await pipe.execute())

        replies = await self.connection.read(read)
        return [stored(doc_id, reply) for doc_id, reply in zip(ids, replies, strict=True)]


def stored(doc_id: str, values: Sequence[bytes | None]) -> Document | None:
    """The document of one HMGET of :data:`STORED_FIELDS`; None when it does not exist."""
    title, text, meta, ver = values
    if ver is None:  # every stored document has a version: the hash does not exist
        return None
    return Document(
        id=doc_id,
        title=(title or b"").decode(),
        text=(text or b"").decode(),
        metadata=json.loads(meta or b"{}"),
        version=int(ver),
    )
