"""The change log's writer, the gateway's side: documents and their shard's log entry in
one Redis transaction (see :mod:`services.index.changelog` for the keys and the entry
format that the shards' readers decode). Reading the documents back is
:mod:`services.index.client.documents`, the logs' tails :mod:`services.index.client.tails`;
all three share one :class:`~services.index.client.connection.StoreConnection`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
from redis.exceptions import NoScriptError, OutOfMemoryError

from services.common.domain import WriteToken
from services.common.errors import GenerationMoved, InvalidArgument, StoreFull, Unavailable
from services.common.limits import LIMITS
from services.index.changelog import TargetVectors, text
from services.index.client import late_vectors
from services.index.client.connection import REDIS_ERRORS, StoreConnection
from services.index.keys import CLOSED, FIRST_GENERATION, GenerationKeys, Layout
from services.telemetry import tracing

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


# The writer gate (docs/generations.md): before anything is written, every shard the
# script touches must have its gate (``wgen:{s}``, in the slot of the shard's documents)
# naming this writer's generation; ARGV[@G] is the generation, ARGV[@G + 1] what an absent
# gate means (g1 on the base layout, closed elsewhere). Refused: the error reply
# ``GENMOVED <gate>`` and nothing written, so a batch stays all or nothing.
_GATE = """
local m = (#KEYS - 2 * n) / 2
for j = 1, m do
  local gate = redis.call('GET', KEYS[2 * n + m + j]) or ARGV[@G + 1]
  if gate ~= ARGV[@G] then return redis.error_reply('GENMOVED ' .. gate) end
end
"""

# KEYS: n doc keys, n version keys, then one log key per shard touched, then the writer
#       gate of each shard touched (same order).
# ARGV: n, dim, generation, absent gate, target encoder ('' none), target dim, then per
#       doc: shard slot (1-based into the log keys), id, title, text, metadata JSON, vector
#       bytes, target vector bytes (7 values per doc, from ARGV[7]).
# Each document hash also keeps ``lid``, its last write's log entry: a rollout's bulk pass
# leaves a document written after its P0 to the replay of that entry
# (services/generations/documents.py ``written_since``).
_UPSERT = (
    """
local n = tonumber(ARGV[1])
local dim = ARGV[2]
local tenc, tdim = ARGV[5], ARGV[6]
"""
    + _GATE.replace("@G", "3")
    + """
local shards = {}
local order = {}
for i = 1, n do
  local a = 7 + (i - 1) * 7
  local slot = tonumber(ARGV[a])
  local doc_id, title, text = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local meta, vec = ARGV[a + 4], ARGV[a + 5]
  local ver = redis.call('INCR', KEYS[n + i])
  redis.call('DEL', KEYS[i])
  redis.call('HSET', KEYS[i], 'title', title, 'text', text, 'meta', meta, 'ver', ver)
  if shards[slot] == nil then
    shards[slot] = {ids = {}, vecs = {}, tags = {}, vers = {}, titles = {}, texts = {},
      tvecs = {}, keys = {}}
    table.insert(order, slot)
  end
  local s = shards[slot]
  table.insert(s.ids, doc_id)
  table.insert(s.vecs, vec)
  table.insert(s.tags, meta)
  table.insert(s.vers, ver)
  table.insert(s.titles, title)
  table.insert(s.texts, text)
  table.insert(s.tvecs, ARGV[a + 6])
  table.insert(s.keys, KEYS[i])
end
local out = {}
for _, slot in ipairs(order) do
  local s = shards[slot]
  local fields = {'op', 'u', 'ids', cjson.encode(s.ids), 'vecs', table.concat(s.vecs),
    'dim', dim, 'tags', '[' .. table.concat(s.tags, ',') .. ']', 'vers', cjson.encode(s.vers),
    'titles', cjson.encode(s.titles), 'texts', cjson.encode(s.texts)}
  if tenc ~= '' then
    for _, v in ipairs({'tenc', tenc, 'tdim', tdim, 'tvecs', table.concat(s.tvecs)}) do
      table.insert(fields, v)
    end
  end
  local id = redis.call('XADD', KEYS[2 * n + slot], '*', unpack(fields))
  for _, key in ipairs(s.keys) do redis.call('HSET', key, 'lid', id) end
  table.insert(out, slot)
  table.insert(out, id)
end
return out
"""
)

# KEYS: as the upsert's. ARGV: n, generation, absent gate, then per doc: shard slot, id.
# Only documents that exist are deleted and logged.
_DELETE = (
    """
local n = tonumber(ARGV[1])
"""
    + _GATE.replace("@G", "2")
    + """
local shards = {}
local order = {}
local deleted = {}
for i = 1, n do
  if redis.call('DEL', KEYS[i]) == 1 then
    local slot = tonumber(ARGV[2 * i + 2])
    local doc_id = ARGV[2 * i + 3]
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
)


def _script_attributes(documents: int, token: WriteToken) -> dict[str, str | int]:
    """A write script's span attributes: the log entries it added (``<shard>:<entry id>``,
    what a shard's ``log apply`` span names: how a write is followed into the shards,
    docs/tracing.md)."""
    return {
        "db.system": "redis",
        "gtr.documents": documents,
        "gtr.log.entries": ",".join(f"{s}:{p}" for s, p in sorted(token.items())),
    }


def moved_to(exc: Exception) -> str | None:
    """The gate's value when ``exc`` is a write script's refusal by its writer gate."""
    words = str(exc).split(" ", 1)
    if isinstance(exc, redis.ResponseError) and words[0] == "GENMOVED" and len(words) == 2:
        return words[1]
    return None


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

    ``dim`` (when given) is checked on every upsert. The Redis (one, or a cluster) and the
    key layout come with ``connection`` (:class:`StoreConnection`, shared with the readers);
    :meth:`connect` opens one of its own, which :meth:`close` closes.

    On one Redis a whole upsert (or delete) batch is one Lua script: all or nothing. On a
    cluster each shard's part of the batch is one script (its keys share the shard's hash
    slot), the parts run concurrently: each is all or nothing, and when one fails the
    call fails (Unavailable; StoreFull when Redis is full) though other shards' parts
    may be written; the retry the client makes is harmless (an upsert again stores the
    same content with a newer version; a delete again reports the deleted ids as not
    found).

    ``keys``: the generation whose logs take the writes and the layout whose documents
    they store (default: generation g1 of the base layout, ``connection.num_shards``
    shards, i.e. the store as it was before generations). Every script first checks the
    writer gate of each shard it touches (``keys.layout.gate(s)``; absent: g1 on the base
    layout, closed elsewhere) and writes nothing unless the gate names ``keys.name``:
    :class:`~services.common.errors.GenerationMoved` carries the gate's value (a
    generation, or ``-`` while a switch drains), and the gateway re-reads the alias and
    writes again (docs/generations.md). On a cluster each shard's part checks its own
    gate, so a switch that closes the gates between two parts refuses only the later one
    (as any failure of one part, above).

    ``wait_replicas`` > 0: after each script, ``WAIT wait_replicas wait_timeout_ms`` on the
    same connection, so a write is acknowledged only once that many replicas of its
    primary have it and survives the primary's loss (a failover promotes a replica).
    Fewer replicas within the timeout: Unavailable (the write is on the primary and may
    or may not survive its loss; retry). What it costs: docs/performance.md, "Redis WAIT".
    """

    def __init__(
        self,
        connection: StoreConnection,
        dim: int | None = None,
        *,
        keys: GenerationKeys | None = None,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        if wait_replicas < 0 or wait_timeout_ms < 0:
            raise ValueError("wait_replicas and wait_timeout_ms must not be negative")
        self.connection = connection
        self.keys = keys if keys is not None else connection.generation_keys()
        self.layout: Layout = self.keys.layout
        # what an absent gate means: g1 on the base layout, closed on any other
        self._absent_gate = (
            FIRST_GENERATION if self.layout.num_shards == self.layout.base else CLOSED
        )
        self.cluster = connection.cluster
        self.dim = dim
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._redis: Any = connection.redis
        self._upsert = self._redis.register_script(_UPSERT)
        self._delete = self._redis.register_script(_DELETE)
        self._owns_connection = False

    @classmethod
    def connect(
        cls,
        redis_url: str,
        num_shards: int,
        dim: int | None = None,
        *,
        max_connections: int = 64,
        pool_timeout_s: float = 5.0,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        keys: GenerationKeys | None = None,
    ) -> ChangeLogWriter:
        """A writer on a connection of its own (closed by :meth:`close`)."""
        connection = StoreConnection(
            redis_url, num_shards, max_connections=max_connections, pool_timeout_s=pool_timeout_s
        )
        wait = {"wait_replicas": wait_replicas, "wait_timeout_ms": wait_timeout_ms}
        writer = cls(connection, dim, keys=keys, **wait)
        writer._owns_connection = True
        return writer

    def _groups(self, ids: Sequence[str]) -> list[list[int]]:
        """Indexes of ``ids`` per script: all in one on one Redis, one per shard on a
        cluster (a script's keys must share a hash slot)."""
        if not self.cluster:
            return [list(range(len(ids)))]
        by_shard: dict[int, list[int]] = {}
        for n, doc_id in enumerate(ids):
            by_shard.setdefault(self.layout.shard(doc_id), []).append(n)
        return [by_shard[s] for s in sorted(by_shard)]

    def _layout(self, ids: Sequence[str]) -> tuple[list[int], list[int]]:
        """(shards touched, sorted; per id its 1-based slot among them)."""
        of = [self.layout.shard(doc_id) for doc_id in ids]
        shards = sorted(set(of))
        slot = {s: n + 1 for n, s in enumerate(shards)}
        return shards, [slot[s] for s in of]

    def _keys(self, ids: Sequence[str], shards: list[int]) -> list[str]:
        keys = [self.layout.doc(i) for i in ids] + [self.layout.version(i) for i in ids]
        return keys + [self.keys.log(s) for s in shards] + [self.layout.gate(s) for s in shards]

    @staticmethod
    def _token(shards: list[int], reply: Sequence[Any]) -> WriteToken:
        return {shards[int(reply[i]) - 1]: text(reply[i + 1]) for i in range(0, len(reply), 2)}

    async def upsert(
        self, records: Sequence[DocRecord], target: TargetVectors | None = None
    ) -> WriteToken:
        """Store and log ``records``; the write token once Redis has acknowledged them.
        ``target``: their vectors by a rollout target's encoder, logged beside (the
        gateway's dual write; :mod:`services.index.changelog`)."""
        vectors = check_records(records, self.dim)
        ids = [r.doc_id for r in records]
        tdim, trows = target.packed(len(records)) if target is not None else (0, [])

        async def part(members: list[int]) -> WriteToken:
            part_ids = [ids[n] for n in members]
            shards, slots = self._layout(part_ids)
            args: list[str | bytes] = [
                str(len(members)),
                str(vectors.shape[1]),
                self.keys.name,
                self._absent_gate,
                target.identity if target is not None else "",
                str(tdim),
            ]
            for n, slot in zip(members, slots, strict=True):
                record = records[n]
                args += [
                    str(slot),
                    record.doc_id,
                    record.title,
                    record.text,
                    json.dumps(record.metadata, sort_keys=True),
                    vectors[n].astype("<f4").tobytes(),
                    trows[n] if trows else b"",
                ]
            with tracing.span("redis upsert script", tracing.CLIENT) as span:
                reply = await self._run(self._upsert, _UPSERT, self._keys(part_ids, shards), args)
                token = self._token(shards, reply)
                if span:
                    span.set_attributes(_script_attributes(len(members), token))
            return token

        token: WriteToken = {}
        for t in await asyncio.gather(*(part(g) for g in self._groups(ids))):
            token.update(t)
        return token

    async def keep_late_vectors(
        self, token: WriteToken, ids: Sequence[str], target: str, vectors: np.ndarray
    ) -> None:
        """:func:`~services.index.client.late_vectors.keep` on this store and keys."""
        await late_vectors.keep(self.connection, self.keys, target, token, ids, vectors)

    async def delete(self, ids: Sequence[str]) -> tuple[WriteToken, list[str], list[str]]:
        """Delete the documents that exist: (write token, deleted ids, ids not found)."""
        check_ids(ids)

        async def part(members: list[int]) -> tuple[WriteToken, list[str]]:
            part_ids = [ids[n] for n in members]
            shards, slots = self._layout(part_ids)
            args: list[str | bytes] = [str(len(part_ids)), self.keys.name, self._absent_gate]
            for doc_id, slot in zip(part_ids, slots, strict=True):
                args += [str(slot), doc_id]
            with tracing.span("redis delete script", tracing.CLIENT) as span:
                deleted_raw, reply = await self._run(
                    self._delete, _DELETE, self._keys(part_ids, shards), args
                )
                token = self._token(shards, reply)
                if span:
                    span.set_attributes(_script_attributes(len(part_ids), token))
            return token, [text(d) for d in deleted_raw]

        token: WriteToken = {}
        gone: set[str] = set()
        for t, deleted_part in await asyncio.gather(*(part(g) for g in self._groups(ids))):
            token.update(t)
            gone.update(deleted_part)
        deleted = [i for i in ids if i in gone]
        return token, deleted, [i for i in ids if i not in gone]

    async def _run(
        self, script: Any, source: str, keys: list[str], args: Sequence[str | bytes]
    ) -> Any:
        """Run a write script (and WAIT for replicas when asked); Unavailable on failure,
        StoreFull when Redis is at ``maxmemory`` with ``noeviction`` (it refuses a script's
        first write that needs memory, so nothing of the batch is stored), GenerationMoved
        when a writer gate refused it (nothing stored)."""
        try:
            async with self.connection.slot():
                if self.wait_replicas == 0:
                    return await script(keys=keys, args=args)
                try:
                    return await self._run_and_wait(script.sha, keys, args)
                except NoScriptError:  # a restarted or new primary: load it, once
                    await self._redis.script_load(source)
                    return await self._run_and_wait(script.sha, keys, args)
        except OutOfMemoryError as exc:
            written = (
                "this shard's part of the batch was not written (other shards' parts may have been)"
                if self.cluster
                else "nothing was written"
            )
            raise StoreFull(
                f"redis: the document store is full (maxmemory reached, noeviction): "
                f"{written}; delete documents or raise the store's maxmemory"
            ) from exc
        except redis.ResponseError as exc:
            gate = moved_to(exc)
            if gate is None:
                raise Unavailable(f"redis: {exc}") from exc
            where = "no generation (a switch drains)" if gate == CLOSED else f"generation {gate}"
            raise GenerationMoved(
                f"the writes of this shard go to {where}, not {self.keys.name}: nothing was "
                "written; write again to the serving generation",
                gate=gate,
            ) from exc
        except REDIS_ERRORS as exc:
            raise Unavailable(f"redis: {exc}") from exc

    async def _run_and_wait(self, sha: str, keys: list[str], args: Sequence[str | bytes]) -> Any:
        """EVALSHA and WAIT in one round trip on one connection: WAIT counts the replicas
        that have this connection's writes, so it must follow the write on its socket."""
        if self.cluster:
            reply, acked = await self._cluster_run_and_wait(sha, keys, args)
        else:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.evalsha(sha, len(keys), *keys, *args)
                pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
                # the script's own error, not the pipeline's rewording of it (a refusal
                # by the writer gate is recognised by its text)
                reply, acked = await pipe.execute(raise_on_error=False)
            for result in (reply, acked):
                if isinstance(result, Exception):
                    raise result
        if int(acked) < self.wait_replicas:
            raise Unavailable(
                f"redis: the write reached {acked} of {self.wait_replicas} replicas within "
                f"{self.wait_timeout_ms} ms (it is on the primary and may not survive its "
                "loss): retry"
            )
        return reply

    async def _cluster_run_and_wait(
        self, sha: str, keys: list[str], args: Sequence[str | bytes]
    ) -> tuple[Any, Any]:
        """On a cluster: both commands on one connection of the primary that serves the
        keys' slot (redis-py's cluster pipeline refuses EVALSHA and could send WAIT on
        another socket). A redirect or a lost node (a failover under way) refreshes the
        slot map and fails this write (Unavailable: the client retries it)."""
        await self._redis.initialize()
        node = self._redis.get_node_from_key(keys[0])
        conn = node.acquire_connection()
        try:
            await conn.send_packed_command(
                conn.pack_commands(
                    [
                        ("EVALSHA", sha, len(keys), *keys, *args),
                        ("WAIT", self.wait_replicas, self.wait_timeout_ms),
                    ]
                )
            )
            replies = []
            for _ in range(2):
                try:
                    replies.append(await conn.read_response())
                except redis.ResponseError as exc:  # an error reply; the other one follows
                    replies.append(exc)
        except BaseException:
            await conn.disconnect()  # replies may be left unread on it
            await self._redis.nodes_manager.initialize()
            raise
        finally:
            node.release(conn)
        reply, acked = replies
        if isinstance(reply, redis.ResponseError):
            if not isinstance(reply, NoScriptError) and moved_to(reply) is None:
                await self._redis.nodes_manager.initialize()  # MOVED, CLUSTERDOWN, ...
            raise reply
        return reply, acked

    async def close(self) -> None:
        """Close the connection if :meth:`connect` opened it (a shared one is its owner's)."""
        if self._owns_connection:
            await self.connection.close()
