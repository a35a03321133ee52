"""The change log in Redis: documents ``doc:{s}:<id>`` and one stream ``log:{s}`` per shard.

Writes (:class:`~services.index.client.writer.ChangeLogWriter`, used by the gateway)
put the document hashes and their shard's log entry in one transaction (a Lua script,
so that the per-document versions and, for deletes, the existence checks happen inside
it): a document exists in the store exactly when its upsert is in its shard's log. One
stream entry carries a whole batch for one shard::

    op    "u" (upsert) | "d" (delete)
    ids   JSON list of document ids
    vecs  packed little-endian float32, len(ids) × dim   (upserts)
    dim   dimension                                       (upserts)
    tags  JSON list of {key: value} metadata per id       (upserts)
    titles, texts  JSON lists of each document's title and text (upserts; what the
          shard's text index indexes, so that it follows the log exactly as the vectors
          do; entries of older writers have none and index an empty text)
    vers  JSON list of per-document versions (INCR of ``ver:{s}:<id>``, monotonic per doc)
    ver   (older writers) one ns timestamp for the whole batch
    tenc, tdim, tvecs  (upserts written while a rollout to another encoder runs: the
          gateway's dual write) the rollout target's encoder (``EncoderSpec.identity()``),
          its dimension and the documents' vectors by it, packed as ``vecs``; the shards
          ignore them, the rollout's catch-up appends them instead of encoding again
          (:class:`TargetVectors`, docs/generations.md "Catch-up under writes")

The entry ID (``<ms>-<seq>``) is the log position: monotonic per shard, so the order of
a shard's log is the order in which every replica applies it (:class:`LogReader`, here:
the keys, the entry format and the reader are the shard side's).
The version counter ``ver:{s}:<id>`` outlives a delete, so a re-upserted document never
reuses a version.

The keys (:mod:`services.index.keys`) carry the shard as a hash tag, so the keys of one
shard's write share one hash slot and the same scripts run on one Redis or a Redis
Cluster.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from services.common import positions
from services.index.core.changes import Change, Delete, Upsert, body_of
from services.index.keys import FIRST_GENERATION, GenerationKeys, Layout

log = logging.getLogger(__name__)

# --- entry format ---------------------------------------------------------------------


def encode_upserts(
    ids: Sequence[str],
    vectors: np.ndarray,
    tags: Sequence[dict[str, str]],
    texts: Sequence[tuple[str, str]] | None = None,
) -> dict[str, bytes | str]:
    """An upsert entry; ``texts``: each document's (title, text), None for none."""
    vecs = np.ascontiguousarray(vectors, dtype="<f4")
    entry: dict[str, bytes | str] = {
        "op": "u",
        "ids": json.dumps(list(ids)),
        "vecs": vecs.tobytes(),
        "dim": str(vecs.shape[1]),
        "tags": json.dumps(list(tags)),
        "ver": str(time.time_ns()),
    }
    if texts is not None:
        entry["titles"] = json.dumps([title for title, _ in texts])
        entry["texts"] = json.dumps([text for _, text in texts])
    return entry


@dataclass(frozen=True)
class TargetVectors:
    """An upsert's vectors by a rollout target's encoder (``identity``:
    ``EncoderSpec.identity()``), one row per document, logged beside its own."""

    identity: str
    vectors: np.ndarray

    def packed(self, n: int) -> tuple[int, list[bytes]]:
        """(dimension, each row as ``tvecs`` packs it); ValueError unless there are ``n``
        finite rows."""
        rows = np.ascontiguousarray(self.vectors, dtype="<f4")
        if rows.ndim != 2 or rows.shape[0] != n or not rows.shape[1]:
            raise ValueError(f"target vectors of shape {rows.shape} for {n} documents")
        if not np.isfinite(rows).all():
            raise ValueError("target vectors: NaN or Inf values")
        return rows.shape[1], [row.tobytes() for row in rows]


def target_vectors(fields: Mapping[bytes, bytes], identity: str) -> np.ndarray | None:
    """The entry's vectors by the encoder ``identity`` names (None: it carries none, or
    another encoder's)."""
    if fields.get(b"tenc") != identity.encode() or b"tvecs" not in fields:
        return None
    n = len(json.loads(fields[b"ids"]))
    return np.frombuffer(fields[b"tvecs"], dtype="<f4").reshape(n, int(fields[b"tdim"]))


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
    titles = json.loads(fields.get(b"titles", b"null")) or [""] * len(ids)
    texts = json.loads(fields.get(b"texts", b"null")) or [""] * len(ids)
    if not len(titles) == len(texts) == len(ids):
        raise ValueError(f"{len(ids)} ids, {len(titles)} titles, {len(texts)} texts")
    return [
        Upsert(doc_id, vectors[i], tags[i], versions[i], body_of(titles[i], texts[i]))
        for i, doc_id in enumerate(ids)
    ]


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# --- the reader (shard side) ----------------------------------------------------------


@dataclass(frozen=True)
class LogEntry:
    position: str
    changes: list[Change]


class LogReader:
    """Blocking, batched reads of one shard's log for the consumer thread of a replica (and
    for the rollout builder, which reads a generation's logs): ``keys`` names the
    generation (default: g1 of a base layout, ``log:{s}``), so the log, the snapshot
    registrations and the trim are that generation's. ``client``: a blocking Redis or
    RedisCluster."""

    def __init__(self, client: Any, shard: int, keys: GenerationKeys | None = None) -> None:
        self._redis: Any = client  # replies are bytes (no decode_responses)
        self.shard = shard
        # g1 of the base layout: its log names do not depend on the shard count
        self.keys = keys if keys is not None else GenerationKeys(FIRST_GENERATION, Layout(1, 1))
        self.key = self.keys.log(shard)
        self._snapshots = self.keys.snapshots(shard)
        self._seen = self.keys.replicas_seen(shard)

    def read(self, after: str, count: int, block_ms: int) -> list[tuple[str, dict[bytes, bytes]]]:
        """Up to ``count`` raw entries after ``after``; waits up to ``block_ms`` for one."""
        reply = self._redis.xread({self.key: after}, count=count, block=block_ms)
        if not reply:
            return []
        return [(text(entry_id), fields) for entry_id, fields in reply[0][1]]

    def tail(self) -> str:
        reply = self._redis.xrevrange(self.key, count=1)
        return text(reply[0][0]) if reply else positions.ZERO

    def first_after(self, position: str) -> str | None:
        """The position of the oldest entry after ``position`` (None: there is none)."""
        reply = self._redis.xrange(self.key, min=f"({position}", max="+", count=1)
        return text(reply[0][0]) if reply else None

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
        oldest_kept = text(first[0]) if first else text(info["last-generated-id"])
        return positions.compare(position, oldest_kept) < 0

    def register_snapshot(self, replica: str, position: str, now: float | None = None) -> None:
        """Record ``replica``'s replay floor and that it is alive (a heartbeat: live replicas
        call this at least every ``heartbeat_s``, with or without a new snapshot)."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(self._snapshots, replica, position)
        pipe.hset(self._seen, replica, repr(time.time() if now is None else now))
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
        key = self._snapshots
        known = {text(r): text(p) for r, p in self._redis.hgetall(key).items()}
        if stale_after_s is not None and known:
            now = time.time() if now is None else now
            seen = {text(r): float(t) for r, t in self._redis.hgetall(self._seen).items()}
            stale = [r for r in known if r in seen and now - seen[r] > stale_after_s]
            if stale:
                pipe = self._redis.pipeline(transaction=True)
                pipe.hdel(key, *stale)
                pipe.hdel(self._seen, *stale)
                pipe.execute()
                for r in stale:
                    del known[r]
                log.warning(
                    "%s: replicas %s not seen for %.0f s: no longer holding the log back",
                    self.key,
                    ", ".join(sorted(stale)),
                    stale_after_s,
                )
        if not known:
            return None
        floor = positions.oldest(*known.values())
        if floor == positions.ZERO:
            return None
        # MINID keeps entries >= floor; the floor entry itself is applied already by all,
        # and keeping it makes "max-deleted-entry-id" < every registered position.
        self._redis.xtrim(self.key, minid=floor, approximate=False)
        return floor
