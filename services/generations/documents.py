"""The stored documents as the rollout reads them: one SCAN over every primary, by layout.

A document hash ``doc:{tag}:<id>`` belongs to the layout whose tag its id maps to; a store
with two shard counts holds both layouts' hashes, and the rollout reads the source's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from services.common import positions
from services.generations.state import ScanCursor
from services.index.changelog import text
from services.index.keys import GenerationKeys

Doc = tuple[str, dict[bytes, bytes]]


def nodes(client: Any) -> list[Any]:
    """One blocking client per primary (a single Redis: itself)."""
    if hasattr(client, "get_primaries"):
        primaries = sorted(client.get_primaries(), key=lambda n: n.name)
        return [client.get_redis_connection(n) for n in primaries]
    return [client]


def doc_id(key: bytes | str, keys: GenerationKeys) -> str | None:
    """The id of a ``doc:`` key of ``keys``' layout, None for another layout's."""
    k = text(key)
    end = k.find("}:")
    if not k.startswith("doc:{") or end < 0:
        return None
    tag = k[4 : end + 1]
    found = k[end + 2 :]
    layout = keys.layout
    return found if layout.tag(layout.shard(found)) == tag else None


def read_docs(client: Any, keys: GenerationKeys, ids: Sequence[str]) -> list[Doc]:
    """(id, hash) of the documents of ``ids`` that exist, in order."""
    if not ids:
        return []
    pipe = client.pipeline(transaction=False)
    for i in ids:
        pipe.hgetall(keys.layout.doc(i))
    return [(i, d) for i, d in zip(ids, pipe.execute(), strict=True) if d]


def written_since(docs: list[Doc], keys: GenerationKeys, p0: Mapping[int, str]) -> list[Doc]:
    """The documents of ``docs`` whose last write is logged after ``p0`` (their hash's
    ``lid``, the writer's log entry, past their shard's P0 position): the catch-up replays
    that entry (with the dual write's vectors), so the bulk pass would encode them for
    nothing, and under steady writes at a paced bulk's rate its SCAN would keep meeting
    new ones. A hash without ``lid`` (an older writer) or a shard without a P0 position
    is not skipped."""
    late = []
    for doc_id, fields in docs:
        lid, mark = fields.get(b"lid"), p0.get(keys.layout.shard(doc_id))
        if lid is not None and mark is not None and positions.compare(text(lid), mark) > 0:
            late.append((doc_id, fields))
    return late


def count(client: Any, keys: GenerationKeys) -> int:
    """How many documents ``keys``' layout holds (a SCAN: the progress bar's total)."""
    n = 0
    for node in nodes(client):
        for key in node.scan_iter(match="doc:*", count=1000):
            n += doc_id(key, keys) is not None
    return n


async def scan(
    client: Any, keys: GenerationKeys, cursor: ScanCursor, batch: int
) -> AsyncIterator[tuple[list[Doc], ScanCursor]]:
    """Batches of (id, doc hash) of ``keys``' layout from ``cursor``, each with the cursor
    after it."""
    primaries = nodes(client)
    if cursor.nodes != len(primaries):
        cursor = ScanCursor()  # the cluster changed: scan again (appends are idempotent)
    node_index, position = cursor.node, cursor.cursor
    while node_index < len(primaries):
        node = primaries[node_index]
        reply = await asyncio.to_thread(
            node.scan, position, match="doc:*", count=max(10, 2 * batch)
        )
        position = int(reply[0])
        ids = list(dict.fromkeys(i for i in (doc_id(k, keys) for k in reply[1]) if i))
        docs = await asyncio.to_thread(read_docs, client, keys, ids)
        if position == 0:
            node_index, position = node_index + 1, 0
        after = ScanCursor(node_index, position, len(primaries))
        yield docs, (ScanCursor.done() if node_index >= len(primaries) else after)
