"""A generation's change logs as the rollout reads them: tails, counts, trims and holds.

A *hold* (``rollout:<T>``, ``rollback:<S>``) is registered like a replica's snapshot in a
log's ``snap:`` hash: the shards do not trim their logs past it, so a replay from that
position stays possible (docs/generations.md, "The rollout").
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import redis

from services.common import positions
from services.index.changelog import text
from services.index.keys import GenerationKeys
from services.process.redis_client import SyncRedis


def _info(client: SyncRedis, key: str) -> dict[str, Any] | None:
    try:
        return dict(client.xinfo_stream(key))  # type: ignore[arg-type]
    except redis.ResponseError:
        return None


def last_id(client: SyncRedis, key: str) -> str:
    """The stream's last generated id (``0-0`` for none): every entry ever added to it is
    at or before it, trimmed or not."""
    info = _info(client, key)
    return positions.ZERO if info is None else text(info["last-generated-id"])


def entries_added(client: SyncRedis, key: str) -> int:
    """How many entries were ever added to the stream (0 for none)."""
    info = _info(client, key)
    return 0 if info is None else int(info.get("entries-added", info["length"]))


def trimmed_past(client: SyncRedis, key: str, position: str) -> bool:
    """True when entries after ``position`` may have been trimmed from ``key`` (as
    :meth:`services.index.changelog.LogReader.trimmed_past`: XTRIM removes the oldest
    entries only, so a position before the first entry left, on a stream that lost
    entries, cannot be replayed)."""
    info = _info(client, key)
    if info is None:
        return False
    if int(info.get("entries-added", info["length"])) - int(info["length"]) <= 0:
        return False
    first = info.get("first-entry")
    oldest_kept = text(first[0]) if first else text(info["last-generated-id"])
    return positions.compare(position, oldest_kept) < 0


def tails(client: SyncRedis, keys: GenerationKeys) -> dict[int, str]:
    """Every shard's :func:`last_id`."""
    return {s: last_id(client, keys.log(s)) for s in range(keys.num_shards)}


def hold(
    client: SyncRedis,
    keys: GenerationKeys,
    at: Mapping[int, str],
    name: str,
    heartbeat: bool = True,
) -> None:
    """Keep ``keys``' shards from trimming their logs past ``at`` (registered like a
    replica's snapshot; without ``heartbeat`` it never goes stale)."""
    now = repr(time.time())
    for shard, position in at.items():
        pipe = client.pipeline(transaction=True)
        pipe.hset(keys.snapshots(shard), name, position)
        if heartbeat:
            pipe.hset(keys.replicas_seen(shard), name, now)
        pipe.execute()


def renew(client: SyncRedis, keys: GenerationKeys, shards: Any, name: str) -> None:
    """Mark hold ``name`` on ``shards`` alive now (the builder's heartbeat)."""
    now = repr(time.time())
    for shard in shards:
        client.hset(keys.replicas_seen(int(shard)), name, now)


def release(client: SyncRedis, keys: GenerationKeys, name: str) -> None:
    """Drop hold ``name`` from every shard of ``keys``."""
    for shard in range(keys.num_shards):
        client.hdel(keys.snapshots(shard), name)
        client.hdel(keys.replicas_seen(shard), name)


def drop_late_vectors(client: SyncRedis, keys: GenerationKeys, target: str) -> None:
    """Delete the dual encodes kept beside ``keys``' logs for rollout target ``target``
    (:mod:`services.index.client.late_vectors`): its rollout ended. One that ends later
    still writes its hash, and the hash's TTL ends it."""
    for shard in range(keys.num_shards):
        client.delete(keys.late_vectors(shard, target))
