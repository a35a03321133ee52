"""The change log in Redis: documents ``doc:{id}`` and one stream ``log:{shard}`` per shard.

Writes (:class:`ChangeLogWriter`, used by the gateway) put the document hashes and
their shard's log entry in one transaction (a Lua script, so that the per-document
versions and, for deletes, the existence checks happen inside it): a document exists in
the store exactly when its upsert is in its shard's log. One stream entry carries a
whole batch for one shard::

    op    "u" (upsert) | "d" (delete)
    ids   JSON list of document ids
    vecs  packed little-endian float32, len(ids) × dim   (upserts)
    dim   dimension                                       (upserts)
    tags  JSON list of {key: value} metadata per id       (upserts)
    vers  JSON list of per-document versions (INCR of ``ver:{id}``, monotonic per doc)
    ver   (older writers) one ns timestamp for the whole batch

The entry ID (``<ms>-<seq>``) is the log position: monotonic per shard, so the order of
a shard's log is the order in which every replica applies it (:class:`LogReader`).
The version counter ``ver:{id}`` outlives a delete, so a re-upserted document never
reuses a version.

All keys of a write go through one script: on Redis Cluster they would need one hash
slot; this service runs one Redis (with replicas for failover), not a cluster.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.common.errors import InvalidArgument, Unavailable
from services.index import positions
from services.index.changes import Change, Delete, Upsert
from services.index.ids import shard_of
from services.index.positions import WriteToken

log = logging.getLogger(__name__)

DOC_PREFIX = "doc:"
LOG_PREFIX = "log:"
VERSION_PREFIX = "ver:"
SNAPSHOT_POSITIONS = "snap:"  # hash per shard: replica → newest snapshot position
REPLICAS_SEEN = "snapseen:"  # hash per shard: replica → unix time of its last registration
MAX_ID_BYTES = 512
MAX_BATCH = 1024


def log_key(shard: int) -> str:
    return f"{LOG_PREFIX}{shard}"


def doc_key(doc_id: str) -> str:
    return f"{DOC_PREFIX}{doc_id}"


def snapshot_positions_key(shard: int) -> str:
    return f"{SNAPSHOT_POSITIONS}{shard}"


def replicas_seen_key(shard: int) -> str:
    return f"{REPLICAS_SEEN}{shard}"


# --- entry format ---------------------------------------------------------------------


def encode_upserts(
    ids: Sequence[str], vectors: np.ndarray, tags: Sequence[dict[str, str]]
) -> dict[str, bytes | str]:
    vecs = np.ascontiguousarray(vectors, dtype="<f4")
    return {
        "op": "u",
        "ids": json.dumps(list(ids)),
        "vecs": vecs.tobytes(),
        "dim": str(vecs.shape[1]),
        "tags": json.dumps(list(tags)),
        "ver": str(time.time_ns()),
    }


def encode_deletes(ids: Sequence[str]) -> dict[str, bytes | str]:
    return {"op": "d", "ids": json.dumps(list(ids)), "ver": str(time.time_ns())}


def _versions(fields: Mapping[bytes, bytes], n: int) -> list[int]:
    if b"vers" in fields:
        return [int(v) for v in json.loads(fields[b"vers"])]
    return [int(fields.get(b"ver", b"0"))] * n


def decode_entry(fields: Mapping[bytes, bytes]) -> list[Change]:
    """The changes of one log entry; ValueError when the entry is malformed."""
    op = fields[b"op"]
    ids = json.loads(fields[b"ids"])
    versions = _versions(fields, len(ids))
    if op == b"d":
        return [Delete(doc_id, v) for doc_id, v in zip(ids, versions, strict=True)]
    if op != b"u":
        raise ValueError(f"unknown op {op!r}")
    dim = int(fields[b"dim"])
    vectors = np.frombuffer(fields[b"vecs"], dtype="<f4").reshape(len(ids), dim)
    tags = json.loads(fields[b"tags"])
    return [Upsert(doc_id, vectors[i], tags[i], versions[i]) for i, doc_id in enumerate(ids)]


# --- the writer (gateway side) ----------------------------------------------------------


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


@dataclass(frozen=True)
class StoredDoc:
    doc_id: str
    title: str
    text: str
    metadata: dict[str, str]
    version: int


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
        return {shards[int(reply[i]) - 1]: _text(reply[i + 1]) for i in range(0, len(reply), 2)}

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
        deleted = [_text(d) for d in deleted_raw]
        gone = set(deleted)
        return self._token(shards, reply), deleted, [i for i in ids if i not in gone]

    async def get(self, doc_id: str) -> StoredDoc | None:
        (doc,) = await self.get_many([doc_id])
        return doc

    async def get_many(self, ids: Sequence[str]) -> list[StoredDoc | None]:
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
        return {s: _text(r[0][0]) for s, r in enumerate(replies) if r}

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


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


_STORED_FIELDS = ("title", "text", "meta", "ver")


def _stored(doc_id: str, values: Sequence[bytes | None]) -> StoredDoc | None:
    title, text, meta, ver = values
    if ver is None:  # every stored document has a version: the hash does not exist
        return None
    return StoredDoc(
        doc_id=doc_id,
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


# --- the reader (shard side) ----------------------------------------------------------


@dataclass(frozen=True)
class LogEntry:
    position: str
    changes: list[Change]


class LogReader:
    """Blocking, batched reads of ``log:{shard}`` for the consumer thread of a replica."""

    def __init__(self, client: redis.Redis, shard: int) -> None:
        self._redis: Any = client  # replies are bytes (no decode_responses)
        self.shard = shard
        self.key = log_key(shard)

    def read(self, after: str, count: int, block_ms: int) -> list[tuple[str, dict[bytes, bytes]]]:
        """Up to ``count`` raw entries after ``after``; waits up to ``block_ms`` for one."""
        reply = self._redis.xread({self.key: after}, count=count, block=block_ms)
        if not reply:
            return []
        return [(_text(entry_id), fields) for entry_id, fields in reply[0][1]]

    def tail(self) -> str:
        reply = self._redis.xrevrange(self.key, count=1)
        return _text(reply[0][0]) if reply else positions.ZERO

    def trimmed_past(self, position: str) -> bool:
        """True when entries after ``position`` may have been trimmed (a replay would miss them).

        Only XTRIM removes entries (never XDEL), so the removed ones are all older than
        the first entry left; a position older than that entry, on a stream that lost
        entries, cannot be replayed. (Redis 7.0 does not update ``max-deleted-entry-id``
        on XTRIM, so that field cannot be used.)
        """
        try:
            info = self._redis.xinfo_stream(self.key)
        except redis.ResponseError:
            return False  # no stream yet: nothing was ever trimmed
        removed = int(info.get("entries-added", info["length"])) - int(info["length"])
        if removed <= 0:
            return False
        first = info.get("first-entry")
        oldest_kept = _text(first[0]) if first else _text(info["last-generated-id"])
        return positions.compare(position, oldest_kept) < 0

    def register_snapshot(self, replica: str, position: str, now: float | None = None) -> None:
        """Record ``replica``'s replay floor and that it is alive (a heartbeat: live replicas
        call this at least every ``heartbeat_s``, with or without a new snapshot)."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(snapshot_positions_key(self.shard), replica, position)
        pipe.hset(replicas_seen_key(self.shard), replica, repr(time.time() if now is None else now))
        pipe.execute()

    def trim_below_snapshots(
        self, stale_after_s: float | None = None, now: float | None = None
    ) -> str | None:
        """Trim entries below the oldest snapshot position of all registered replicas.

        A replica not seen for ``stale_after_s`` seconds is taken as removed (scaled
        down, renamed): its registration is deleted so that it no longer holds the log
        back. Should it come back after all, its start finds the log trimmed past its
        snapshot and refuses to serve (``ShardReplica.start``) instead of missing changes.
        A registration without a heartbeat (written by an older version) counts as live.
        Returns the floor used (None when nothing may be trimmed).
        """
        key = snapshot_positions_key(self.shard)
        known = {_text(r): _text(p) for r, p in self._redis.hgetall(key).items()}
        if stale_after_s is not None and known:
            now = time.time() if now is None else now
            seen = {_text(r): float(t) for r, t in self._redis.hgetall(
                replicas_seen_key(self.shard)).items()}  # fmt: skip
            stale = [r for r in known if r in seen and now - seen[r] > stale_after_s]
            if stale:
                pipe = self._redis.pipeline(transaction=True)
                pipe.hdel(key, *stale)
                pipe.hdel(replicas_seen_key(self.shard), *stale)
                pipe.execute()
                for r in stale:
                    del known[r]
                log.warning(
                    "log:%d: replicas %s not seen for %.0f s: no longer holding the log back",
                    self.shard, ", ".join(sorted(stale)), stale_after_s,
                )  # fmt: skip
        if not known:
            return None
        floor = positions.oldest(*known.values())
        if floor == positions.ZERO:
            return None
        # MINID keeps entries >= floor; the floor entry itself is applied already by all,
        # and keeping it makes "max-deleted-entry-id" < every registered position.
        self._redis.xtrim(self.key, minid=floor, approximate=False)
        return floor
