"""The gateway's document store: Redis hashes ``doc:{id}`` + the shards' change logs.

A write puts the document hash and its shard's log entry in one transaction (MULTI/EXEC
for upserts, a Lua script for deletes so that only existing documents are logged), so a
document exists in the store exactly when its change is in the log. The entry format is
the index's (:mod:`services.index.changelog`).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import redis
import redis.asyncio as aioredis

from services.common.errors import Unavailable
from services.gateway.domain import Document
from services.index.changelog import doc_key, encode_upserts, log_key
from services.index.ids import shard_of


def _document(doc_id: str, fields: dict[bytes, bytes]) -> Document:
    return Document(
        id=doc_id,
        title=fields.get(b"title", b"").decode(),
        text=fields.get(b"text", b"").decode(),
        metadata=json.loads(fields.get(b"meta", b"{}")),
    )


# Delete exactly the documents that exist and log them, atomically.
# KEYS: doc keys (n), then log keys (one per shard that appears in ARGV)
# ARGV: n, then per document its shard index into the log keys (1-based), then the
# serialized delete entry is built here per shard.
_DELETE_SCRIPT = """
local n = tonumber(ARGV[1])
local per_shard = {}
local order = {}
local deleted = {}
for i = 1, n do
  if redis.call('DEL', KEYS[i]) == 1 then
    local s = tonumber(ARGV[1 + i])
    if per_shard[s] == nil then per_shard[s] = {}; table.insert(order, s) end
    table.insert(per_shard[s], ARGV[1 + n + i])
    table.insert(deleted, ARGV[1 + n + i])
  end
end
local positions = {}
local ver = ARGV[2 + 2 * n]
for _, s in ipairs(order) do
  local id = redis.call('XADD', KEYS[n + s], '*', 'op', 'd',
                        'ids', cjson.encode(per_shard[s]), 'ver', ver)
  table.insert(positions, s)
  table.insert(positions, id)
end
return {deleted, positions}
"""


@dataclass
class RedisDocumentStore:
    """The gateway's view: documents + logs (implements ``gateway.ports.DocumentStore``)."""

    url: str
    num_shards: int

    def __post_init__(self) -> None:
        self._redis = aioredis.Redis.from_url(self.url, socket_timeout=5.0)
        self._delete = self._redis.register_script(_DELETE_SCRIPT)

    async def upsert(self, docs: Sequence[Document], vectors: np.ndarray) -> dict[int, str]:
        by_shard: dict[int, list[int]] = defaultdict(list)
        for row, doc in enumerate(docs):
            by_shard[shard_of(doc.id, self.num_shards)].append(row)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                for doc in docs:
                    pipe.hset(
                        doc_key(doc.id),
                        mapping={
                            "title": doc.title,
                            "text": doc.text,
                            "meta": json.dumps(doc.metadata),
                        },
                    )
                shards = sorted(by_shard)
                for shard in shards:
                    rows = by_shard[shard]
                    entry = encode_upserts(
                        [docs[r].id for r in rows], vectors[rows], [docs[r].metadata for r in rows]
                    )
                    pipe.xadd(log_key(shard), entry)  # type: ignore[arg-type]
                results = await pipe.execute()
        except redis.RedisError as exc:
            raise Unavailable(f"redis: {exc}") from exc
        ids = results[len(docs) :]
        return {shard: ids[i].decode() for i, shard in enumerate(shards)}

    async def delete(self, ids: Sequence[str]) -> tuple[dict[int, str], list[str], list[str]]:
        shards = sorted({shard_of(i, self.num_shards) for i in ids})
        index_of = {s: n + 1 for n, s in enumerate(shards)}
        keys = [doc_key(i) for i in ids] + [log_key(s) for s in shards]
        args = [
            str(len(ids)),
            *[str(index_of[shard_of(i, self.num_shards)]) for i in ids],
            *ids,
            str(time.time_ns()),
        ]
        try:
            deleted_raw, positions_raw = await self._delete(keys=keys, args=args)
        except redis.RedisError as exc:
            raise Unavailable(f"redis: {exc}") from exc
        deleted = [d.decode() for d in deleted_raw]
        token = {
            shards[int(positions_raw[i]) - 1]: positions_raw[i + 1].decode()
            for i in range(0, len(positions_raw), 2)
        }
        gone = set(deleted)
        return token, deleted, [i for i in ids if i not in gone]

    async def get_many(self, ids: Sequence[str]) -> list[Document | None]:
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for doc_id in ids:
                    pipe.hgetall(doc_key(doc_id))
                rows = await pipe.execute()
        except redis.RedisError as exc:
            raise Unavailable(f"redis: {exc}") from exc
        return [_document(i, r) if r else None for i, r in zip(ids, rows, strict=True)]

    async def close(self) -> None:
        await self._redis.aclose()
