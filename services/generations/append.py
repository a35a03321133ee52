"""Idempotent appends into a target generation's change logs (docs/generations.md,
"Idempotent appends").

The rollout builder writes a target generation's logs twice over the same documents: the
bulk pass (every stored document, with its stored version) and the replay of the source
logs (every write since P0, with the version the gateway's writer gave it). A builder
killed mid-batch runs that batch again. One Lua script per target shard (per part of a
long batch: :data:`SCRIPT_ITEMS`) makes all of it harmless: an upsert or delete of
version ``v`` is appended only when ``v`` is newer than ``lv[id]`` (the hash
:meth:`GenerationKeys.logged` of that shard), and ``lv[id] := v`` in the same script, so

- re-running any batch appends nothing twice;
- an older version never overtakes a newer one (a bulk read of version 5 after the replay
  appended version 6 is dropped), whatever the order of the passes.

For a target with another shard count (a reshard) the same script writes the document
copy into the target layout (``doc:{N.s}:<id>``, or deletes it) and raises the target
layout's version counter (``ver:{N.s}:<id>``) to at least ``v``, so the gateway's writes
after the switch (INCR of that counter) get versions newer than every copied one. Every
key of one call carries the target shard's hash tag: one slot on a Redis Cluster.

Versions: the bulk pass of ``--retrain`` takes its vectors from the source's replicas,
which know no per-document version; it appends them as version 0 (:data:`RETRAIN_VERSION`),
which every real version (≥ 1) overtakes: the replay from P0 re-appends every document
written after P0 with its real version. An absent ``lv[id]`` counts as -1.

The entries have the format of :mod:`services.index.changelog` (``vers``, ``titles``,
``texts``, ``tags``), so the target's shards apply them as any gateway write.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.index.changelog import text
from services.index.keys import GenerationKeys

RETRAIN_VERSION = 0  # the version of a vector reused from the source's replicas

# One script holds Redis: every other client's command (the serving gateway's document
# fetches and writes, the shards' log reads) waits until it ends. So one script appends at
# most SCRIPT_ITEMS items and about SCRIPT_BYTES of upsert payload; a longer batch is
# several scripts, each one log entry. 256 retrain upserts of 1,000-character texts and
# 384-d vectors (~700 KB) in one script held an idle Redis 8.8 ms (16 scripts of 16: 0.5
# ms each) and up to 32 ms during a retrain rollout on a 2-vCPU EPYC VM (SLOWLOG,
# 2026-12-01; docs/generations.md "The builder's appends held Redis").
SCRIPT_ITEMS = 16
SCRIPT_BYTES = 64 * 1024

# KEYS: [1] the target shard's log, [2] its lv hash, then (copy) per item its doc key and
#       version key in the target layout.
# ARGV: op ('u' | 'd'), n, copy ('1' | '0'), dim (upserts), then per item
#       upserts: id, version, title, text, metadata JSON, vector bytes (6 values)
#       deletes: id, version (2 values)
# Returns {} when nothing was newer, else {entry id, appended id, ...}.
_APPEND = """
local op, n, copy, dim = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1', ARGV[4]
local width = 2
if op == 'u' then width = 6 end
local ids, vers, vecs, tags, titles, texts = {}, {}, {}, {}, {}, {}
for i = 1, n do
  local a = 5 + (i - 1) * width
  local id, v = ARGV[a], tonumber(ARGV[a + 1])
  local last = redis.call('HGET', KEYS[2], id)
  if last == false or tonumber(last) < v then
    redis.call('HSET', KEYS[2], id, ARGV[a + 1])
    table.insert(ids, id)
    table.insert(vers, v)
    local doc, ver = KEYS[1 + 2 * i], KEYS[2 + 2 * i]
    if op == 'u' then
      table.insert(titles, ARGV[a + 2])
      table.insert(texts, ARGV[a + 3])
      table.insert(tags, ARGV[a + 4])
      table.insert(vecs, ARGV[a + 5])
      if copy then
        redis.call('DEL', doc)
        redis.call('HSET', doc, 'title', ARGV[a + 2], 'text', ARGV[a + 3],
          'meta', ARGV[a + 4], 'ver', ARGV[a + 1])
      end
    elseif copy then
      redis.call('DEL', doc)
    end
    if copy then
      local current = tonumber(redis.call('GET', ver) or '0')
      if current < v then redis.call('SET', ver, ARGV[a + 1]) end
    end
  end
end
if #ids == 0 then return {} end
local entry
if op == 'u' then
  entry = redis.call('XADD', KEYS[1], '*', 'op', 'u', 'ids', cjson.encode(ids),
    'vecs', table.concat(vecs), 'dim', dim, 'tags', '[' .. table.concat(tags, ',') .. ']',
    'vers', cjson.encode(vers), 'titles', cjson.encode(titles), 'texts', cjson.encode(texts))
else
  entry = redis.call('XADD', KEYS[1], '*', 'op', 'd', 'ids', cjson.encode(ids),
    'vers', cjson.encode(vers))
end
local out = {entry}
for _, id in ipairs(ids) do table.insert(out, id) end
return out
"""


@dataclass(frozen=True)
class UpsertItem:
    """One document to append as an upsert: the stored fields and its new vector."""

    doc_id: str
    version: int
    vector: np.ndarray
    title: str = ""
    text: str = ""
    meta: str = "{}"  # the stored metadata JSON (the writer's sorted-keys dump)


@dataclass(frozen=True)
class DeleteItem:
    doc_id: str
    version: int


@dataclass
class Appended:
    """What one call appended: per target shard the entry id, and the ids appended."""

    entries: dict[int, str] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.ids)


def meta_json(tags: dict[str, str]) -> str:
    """Metadata as the writer stores it (``doc:`` ``meta``, and the log's ``tags``)."""
    return json.dumps(tags, sort_keys=True)


class TargetAppender:
    """Appends into ``target``'s logs (``client``: a blocking Redis or RedisCluster).

    ``copy_documents``: the target's layout is not the source's (a reshard): write the
    document copies and raise the version counters of the target layout too.
    """

    def __init__(self, client: Any, target: GenerationKeys, *, copy_documents: bool) -> None:
        self.redis: Any = client
        self.target = target
        self.copy_documents = copy_documents
        self._script = client.register_script(_APPEND)

    def _by_shard(self, ids: Sequence[str]) -> dict[int, list[int]]:
        by: dict[int, list[int]] = {}
        for n, doc_id in enumerate(ids):
            by.setdefault(self.target.layout.shard(doc_id), []).append(n)
        return by

    def _keys(self, shard: int, ids: Sequence[str]) -> list[str]:
        keys = [self.target.log(shard), self.target.logged(shard)]
        if self.copy_documents:
            for doc_id in ids:
                keys += [self.target.layout.doc(doc_id), self.target.layout.version(doc_id)]
        return keys

    def _run(self, shard: int, ids: list[str], args: list[str | bytes], out: Appended) -> None:
        reply = self._script(keys=self._keys(shard, ids), args=args)
        if reply:
            out.entries[shard] = text(reply[0])
            out.ids += [text(i) for i in reply[1:]]

    def upserts(self, items: Sequence[UpsertItem]) -> Appended:
        """Append the items newer than what this generation's logs hold (per target shard
        touched, one entry per script of at most :data:`SCRIPT_ITEMS` items and about
        :data:`SCRIPT_BYTES`). An id appears at most once."""
        out = Appended()
        if not items:
            return out
        _check_unique([i.doc_id for i in items])
        dim = int(np.asarray(items[0].vector).shape[-1])
        for shard, members in sorted(self._by_shard([i.doc_id for i in items]).items()):
            for part in _bounded(members, lambda n: _payload(items[n])):
                args: list[str | bytes] = ["u", str(len(part)), self._copy, str(dim)]
                for n in part:
                    item = items[n]
                    vector = np.asarray(item.vector, dtype="<f4").reshape(-1)
                    if vector.shape[0] != dim:
                        raise ValueError(f"{item.doc_id!r}: dimension {vector.shape[0]}, not {dim}")
                    args += [
                        item.doc_id,
                        str(item.version),
                        item.title,
                        item.text,
                        item.meta,
                        vector.tobytes(),
                    ]
                self._run(shard, [items[n].doc_id for n in part], args, out)
        return out

    def deletes(self, items: Sequence[DeleteItem]) -> Appended:
        """Append the deletes newer than what this generation's logs hold."""
        out = Appended()
        if not items:
            return out
        _check_unique([i.doc_id for i in items])
        for shard, members in sorted(self._by_shard([i.doc_id for i in items]).items()):
            for part in _bounded(members, lambda n: len(items[n].doc_id)):
                args: list[str | bytes] = ["d", str(len(part)), self._copy, "0"]
                for n in part:
                    args += [items[n].doc_id, str(items[n].version)]
                self._run(shard, [items[n].doc_id for n in part], args, out)
        return out

    @property
    def _copy(self) -> str:
        return "1" if self.copy_documents else "0"


def _payload(item: UpsertItem) -> int:
    """About the bytes ``item`` adds to a script's arguments and to its log entry."""
    size = len(item.doc_id) + len(item.title) + len(item.text) + len(item.meta)
    return size + int(np.asarray(item.vector).size) * 4


def _bounded(members: list[int], size: Callable[[int], int]) -> Iterator[list[int]]:
    """``members`` in order, in parts of at most :data:`SCRIPT_ITEMS` whose sizes add
    up to at most :data:`SCRIPT_BYTES` (a part of one larger item holds it alone)."""
    part: list[int] = []
    total = 0
    for n in members:
        grows = size(n)
        if part and (len(part) == SCRIPT_ITEMS or total + grows > SCRIPT_BYTES):
            yield part
            part, total = [], 0
        part.append(n)
        total += grows
    if part:
        yield part


def _check_unique(ids: Sequence[str]) -> None:
    if len(set(ids)) != len(ids):
        raise ValueError("an id appears twice in one append (split the batch)")
