"""The change log's writer, the gateway's side: documents and their shard's log entry in
one Redis transaction (see :mod:`services.index.changelog` for the keys and the entry
format that the shards' readers decode)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.common.domain import Document, WriteToken
from services.common.errors import InvalidArgument, Unavailable
from services.common.limits import LIMITS
from services.index.changelog import VERSION_PREFIX, doc_key, log_key, text
from services.index.core.ids import shard_of

MAX_ID_BYTES = LIMITS.max_id_bytes
MAX_BATCH = LIMITS.max_delete_ids


@dataclass(frozen=True)
class DocRecord:
    """One document to upsert: its id, its embedding and the fields the store keeps.

    ``metadata`` (string → string) is stored with the document and is also what search
    filters match on (the shard's tags).
    """

    doc_id: str
    vector: np.ndarray
    title: str = ""
    text: str = ""
    metadata: dict[str, str] = field(default_factory=dict)


# KEYS: n doc keys, n version keys, then one log key per shard touched.
# ARGV: n, dim, then per doc: shard slot (1-based into the log keys), id, title, text,
#       metadata JSON, vector bytes (6 values per doc, starting at ARGV[3]).
_UPSERT = """
local n = tonumber(ARGV[1])
local dim = ARGV[2]
local shards = {}
local order = {}
for i = 1, n do
  local a = 3 + (i - 1) * 6
  local slot = tonumber(ARGV[a])
  local doc_id, title, text = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local meta, vec = ARGV[a + 4], ARGV[a + 5]
  local ver = redis.call('INCR', KEYS[n + i])
  redis.call('DEL', KEYS[i])
  redis.call('HSET', KEYS[i], 'title', title, 'text', text, 'meta', meta, 'ver', ver)
  if shards[slot] == nil then
    shards[slot] = {ids = {}, vecs = {}, tags = {}, vers = {}}
    table.insert(order, slot)
  end
  local s = shards[slot]
  table.insert(s.ids, doc_id)
  table.insert(s.vecs, vec)
  table.insert(s.tags, meta)
  table.insert(s.vers, ver)
end
local out = {}
for _, slot in ipairs(order) do
  local s = shards[slot]
  local id = redis.call('XADD', KEYS[2 * n + slot], '*',
    'op', 'u', 'ids', cjson.encode(s.ids), 'vecs', table.concat(s.vecs), 'dim', dim,
    'tags', '[' .. table.concat(s.tags, ',') .. ']', 'vers', cjson.encode(s.vers))
  table.insert(out, slot)
  table.insert(out, id)
end
return out
"""

# KEYS: n doc keys, n version keys, then one log key per shard touched.
# ARGV: n, then per doc: shard slot, id. Only documents that exist are deleted and logged.
_DELETE = """
local n = tonumber(ARGV[1])
local shards = {}
local order = {}
local deleted = {}
for i = 1, n do
  if redis.call('DEL', KEYS[i]) == 1 then
    local slot = tonumber(ARGV[2 * i])
    local doc_id = ARGV[2 * i + 1]
    local ver = redis.call('INCR', KEYS[n + i])
    if shards[slot] == nil then shards[slot] = {ids = {}, vers = {}}; table.insert(order, slot) end
    table.insert(shards[slot].ids, doc_id)
    table.insert(shards[slot].vers, ver)
    table.insert(deleted, doc_id)
  end
end
local out = {}
for _, slot in ipairs(order) do
  local id = redis.call('XADD', KEYS[2 * n + slot], '*', 'op', 'd',
    'ids', cjson.encode(shards[slot].ids), 'vers', cjson.encode(shards[slot].vers))
  table.insert(out, slot)
  table.insert(out, id)
end
return {deleted, out}
"""


def check_ids(ids: Sequence[str]) -> None:
    """InvalidArgument for an empty batch, an empty/oversized id or a duplicate id."""
    if not 1 <= len(ids) <= MAX_BATCH:
        raise InvalidArgument(f"ids: {len(ids)} documents, takes 1..{MAX_BATCH}")
    seen: set[str] = set()
    for doc_id in ids:
        if not isinstance(doc_id, str) or not doc_id:
            raise InvalidArgument("ids: a document id is empty")
        if len(doc_id.encode("utf-8")) > MAX_ID_BYTES:
            raise InvalidArgument(f"ids: {doc_id[:40]!r}… is longer than {MAX_ID_BYTES} bytes")
        if doc_id in seen:
            raise InvalidArgument(f"ids: {doc_id!r} appears twice in the batch")
        seen.add(doc_id)


def check_records(records: Sequence[DocRecord], dim: int | None) -> np.ndarray:
    """Validate a batch of upserts; their vectors as one float32 (n, dim) matrix."""
    check_ids([r.doc_id for r in records])
    rows = [np.asarray(r.vector, dtype=np.float32) for r in records]
    if any(row.ndim != 1 for row in rows):
        raise InvalidArgument("vector: each record needs a 1-D vector")
    want = dim if dim is not None else rows[0].shape[0]
    for record, row in zip(records, rows, strict=True):
        if row.shape[0] != want or want == 0:
            raise InvalidArgument(
                f"vector of {record.doc_id!r}: dimension {row.shape[0]}, expected {want}"
            )
        if not np.isfinite(row).all():
            raise InvalidArgument(f"vector of {record.doc_id!r}: NaN or Inf values")
        for key, value in record.metadata.items():
            if not isinstance(key, str) or not isinstance(value, str) or not key:
                raise InvalidArgument(
                    f"metadata of {record.doc_id!r}: keys and values must be strings"
                )
    return np.stack(rows)


class ChangeLogWriter:
    """Upserts and deletes: the document hashes and the shard logs in one transaction.

    ``dim`` (when given) is checked on every upsert; ``num_shards`` is fixed for the
    lifetime of the log (the shard of a document is ``shard_of(id, num_shards)``).
    """

    def __init__(
        self,
        redis_url: str,
        num_shards: int,
        dim: int | None = None,
        *,
        max_connections: int = 64,
        pool_timeout_s: float = 5.0,
        read_retry_s: float = 3.0,
    ) -> None:
        if num_shards < 1:
            raise ValueError("num_shards must be positive")
        self.num_shards = num_shards
        self.dim = dim
        self.read_retry_s = read_retry_s
        self._redis: Any = aioredis.Redis.from_pool(
            redis_pool(redis_url, max_connections=max_connections, timeout=pool_timeout_s)
        )
        self._upsert = self._redis.register_script(_UPSERT)
        self._delete = self._redis.register_script(_DELETE)

    def _layout(self, ids: Sequence[str]) -> tuple[list[int], list[int]]:
        """(shards touched, sorted; per id its 1-based slot among them)."""
        of = [shard_of(doc_id, self.num_shards) for doc_id in ids]
        shards = sorted(set(of))
        slot = {s: n + 1 for n, s in enumerate(shards)}
        return shards, [slot[s] for s in of]

    @staticmethod
    def _token(shards: list[int], reply: Sequence[Any]) -> WriteToken:
        return {shards[int(reply[i]) - 1]: text(reply[i + 1]) for i in range(0, len(reply), 2)}

    async def upsert(self, records: Sequence[DocRecord]) -> WriteToken:
        """Store and log ``records``; the write token once Redis has acknowledged them."""
        vectors = check_records(records, self.dim)
        ids = [r.doc_id for r in records]
        shards, slots = self._layout(ids)
        keys = [doc_key(i) for i in ids] + [VERSION_PREFIX + i for i in ids]
        keys += [log_key(s) for s in shards]
        args: list[str | bytes] = [str(len(records)), str(vectors.shape[1])]
        for record, slot, row in zip(records, slots, vectors, strict=True):
            args += [
                str(slot),
                record.doc_id,
                record.title,
                record.text,
                json.dumps(record.metadata, sort_keys=True),
                row.astype("<f4").tobytes(),
            ]
        try:
            reply = await self._upsert(keys=keys, args=args)
        except redis.RedisError as exc:
            raise Unavailable(f"redis: {exc}") from exc
        return self._token(shards, reply)

    async def delete(self, ids: Sequence[str]) -> tuple[WriteToken, list[str], list[str]]:
        """Delete the documents that exist: (write token, deleted ids, ids not found)."""
        check_ids(ids)
        shards, slots = self._layout(ids)
        keys = [doc_key(i) for i in ids] + [VERSION_PREFIX + i for i in ids]
        keys += [log_key(s) for s in shards]
        args: list[str] = [str(len(ids))]
        for doc_id, slot in zip(ids, slots, strict=True):
            args += [str(slot), doc_id]
        try:
            deleted_raw, reply = await self._delete(keys=keys, args=args)
        except redis.RedisError as exc:
            raise Unavailable(f"redis: {exc}") from exc
        deleted = [text(d) for d in deleted_raw]
        gone = set(deleted)
        return self._token(shards, reply), deleted, [i for i in ids if i not in gone]

    async def get(self, doc_id: str) -> Document | None:
        (doc,) = await self.get_many([doc_id])
        return doc

    async def get_many(self, ids: Sequence[str]) -> list[Document | None]:
        """The stored documents of ``ids`` (None where one does not exist), in one
        pipelined round trip: a search fetches all of its hits at once instead of one
        request (and one pooled connection) per hit."""
        if not ids:
            return []

        async def read() -> list[Any]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for doc_id in ids:
                    pipe.hmget(doc_key(doc_id), *_STORED_FIELDS)
                return list(await pipe.execute())

        replies = await self._read(read)
        return [_stored(doc_id, reply) for doc_id, reply in zip(ids, replies, strict=True)]

    async def tail(self) -> WriteToken:
        """The newest position of every shard's log (what a STRONG read waits for)."""

        async def read() -> list[Any]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for shard in range(self.num_shards):
                    pipe.xrevrange(log_key(shard), count=1)
                return list(await pipe.execute())

        replies = await self._read(read)
        return {s: text(r[0][0]) for s, r in enumerate(replies) if r}

    async def _read(self, read: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        """Run an idempotent read; while Redis cannot be reached (a restart takes about a
        second), try again with backoff for up to ``read_retry_s``, then Unavailable.
        The caller's deadline bounds it too (it cancels the wait)."""
        give_up = time.monotonic() + self.read_retry_s
        pause = 0.05
        while True:
            try:
                return await read()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if time.monotonic() + pause > give_up:
                    raise Unavailable(f"redis: {exc}") from exc
                await asyncio.sleep(pause)
                pause = min(2 * pause, 0.5)
            except redis.RedisError as exc:
                raise Unavailable(f"redis: {exc}") from exc

    async def close(self) -> None:
        await self._redis.aclose()


_STORED_FIELDS = ("title", "text", "meta", "ver")


def _stored(doc_id: str, values: Sequence[bytes | None]) -> Document | None:
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


def redis_pool(
    url: str, *, max_connections: int, timeout: float, socket_timeout: float = 5.0
) -> aioredis.BlockingConnectionPool:
    """A bounded pool for an asyncio client: at most ``max_connections`` sockets; a caller
    that finds them all busy waits up to ``timeout`` s for one (then ConnectionError)
    instead of failing at once ("Too many connections", redis-py's default pool).

    Connections idle for over a second are PINGed before use, so a pool that outlived a
    Redis restart reconnects instead of failing its next requests; a command that fails
    on a broken connection is retried once on a fresh one. A retried write may run twice
    when the first attempt reached Redis and only its reply was lost: an upsert is then
    logged twice (same content, a newer version), harmless for every reader.
    """
    return aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        health_check_interval=1,
        retry=Retry(NoBackoff(), 1),
        retry_on_error=[redis.ConnectionError],
    )
