"""Rewrite a store of key layout 1 (``doc:<id>``, ``log:<s>``) into layout 2 (hash tags).

``gtr-retrieval redis migrate --redis-url URL --shards N`` runs :func:`migrate`. It is
meant to run while the gateway and the shards are stopped (they refuse to start while
``gtr:layout`` says a migration is under way), it is idempotent (run on a migrated
store it changes nothing) and resumable (interrupted, it is run again and finishes):

1. ``gtr:layout`` := ``version 1, migrating 2, shards N``.
2. The ids of every ``doc:<id>`` and ``ver:<id>`` key go into the set
   ``gtr:migrate:ids`` (SCAN of every primary), then ``listed`` is recorded. Until then
   no key is rewritten, so a repeated listing sees only layout-1 keys; after it the set,
   not a key's name, says what is left (an id may itself look like ``{3}:x``).
3. Per batch of ids: ``DUMP`` the old key, ``RESTORE … REPLACE`` it under its new name,
   ``DEL`` the old one, then ``SREM`` the ids. A batch cut short is done again: a
   ``RESTORE REPLACE`` of the same bytes is harmless, a missing old key is skipped.
4. Each shard's ``log:<s>``, ``snap:<s>``, ``snapseen:<s>`` the same way (DUMP/RESTORE
   keeps a stream's entry ids and its trimming metadata, so replicas resume from their
   snapshots' positions).
5. ``gtr:layout`` := ``version 2, shards N``; the set is deleted.

DUMP/RESTORE works across hash slots and nodes, so the same code migrates a single Redis
in place and works on a cluster's keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from services.common.errors import FailedPrecondition
from services.index.core.ids import shard_of
from services.index.keys import (
    LAYOUT_KEY,
    LAYOUT_VERSION,
    V1_DOC_PREFIX,
    V1_VERSION_PREFIX,
    doc_key,
    log_key,
    v1_shard_keys,
    version_key,
)
from services.index.layout import check_layout, read_layout, v1_keys_present

PENDING_IDS = "gtr:migrate:ids"
_V1_LOG = re.compile(r"^log:(\d+)$")


@dataclass
class MigrationReport:
    already: bool = False  # the store had layout 2 already: nothing was changed
    documents: int = 0  # ids whose keys were moved in this run
    shard_keys: int = 0  # logs and registrations moved in this run
    keys_moved: int = 0


Progress = Callable[[MigrationReport], None]


def migrate(
    client: Any, num_shards: int, *, batch: int = 500, progress: Progress | None = None
) -> MigrationReport:
    """Bring the store of ``client`` (blocking Redis or RedisCluster) to layout 2."""
    if num_shards < 1 or batch < 1:
        raise ValueError("num_shards and batch must be positive")
    report = MigrationReport()
    layout = read_layout(client)
    if layout and "migrating" not in layout:
        version = int(layout.get("version", "1"))
        if version == LAYOUT_VERSION:
            _check_shards(layout, num_shards)
            report.already = True
            return report
        if version > LAYOUT_VERSION:
            raise FailedPrecondition(f"the store has layout {version}, newer than this code's")
    if "migrating" in layout:
        _check_shards(layout, num_shards)
    else:
        _check_v1_shards(client, num_shards)
        if _present(client, [log_key(s) for s in range(num_shards)]):
            # Written by this code before any service recorded the layout (a writer
            # used on its own): layout 2 already, unless layout-1 keys are there too.
            old = v1_keys_present(client, num_shards)
            if old:
                raise FailedPrecondition(
                    f"the store holds keys of both layouts ({old[0]} and {log_key(0)}...)"
                )
            check_layout(client, num_shards)
            report.already = True
            return report
        client.hset(
            LAYOUT_KEY,
            mapping={"version": "1", "migrating": str(LAYOUT_VERSION), "shards": str(num_shards)},
        )
    if read_layout(client).get("listed") != "1":
        _list_ids(client, batch)
        client.hset(LAYOUT_KEY, "listed", "1")
    while True:
        ids = [_s(i) for i in client.srandmember(PENDING_IDS, batch) or []]
        if not ids:
            break
        moves = []
        for doc_id in ids:
            shard = shard_of(doc_id, num_shards)
            moves.append((V1_DOC_PREFIX + doc_id, doc_key(shard, doc_id)))
            moves.append((V1_VERSION_PREFIX + doc_id, version_key(shard, doc_id)))
        report.keys_moved += _move(client, moves)
        client.srem(PENDING_IDS, *ids)
        report.documents += len(ids)
        if progress is not None:
            progress(report)
    for shard in range(num_shards):
        moved = _move(client, v1_shard_keys(shard).items())
        report.shard_keys += moved
        report.keys_moved += moved
    client.delete(PENDING_IDS)
    client.hset(LAYOUT_KEY, mapping={"version": str(LAYOUT_VERSION), "shards": str(num_shards)})
    client.hdel(LAYOUT_KEY, "migrating", "listed")
    if progress is not None:
        progress(report)
    return report


def _check_shards(layout: dict[str, str], num_shards: int) -> None:
    shards = int(layout.get("shards", num_shards))
    if shards != num_shards:
        raise FailedPrecondition(
            f"the store is recorded with {shards} shards, --shards says {num_shards}"
        )


def _check_v1_shards(client: Any, num_shards: int) -> None:
    """A layout-1 log of a shard >= num_shards means --shards is wrong: its documents
    would be filed under the wrong shards."""
    beyond = sorted(
        int(m.group(1))
        for key in client.scan_iter(match="log:*", count=1000)
        if (m := _V1_LOG.match(_s(key))) and int(m.group(1)) >= num_shards
    )
    if beyond:
        raise FailedPrecondition(
            f"the store has the log of shard {beyond[-1]}: it was written with at least "
            f"{beyond[-1] + 1} shards, not --shards {num_shards}"
        )


def _list_ids(client: Any, batch: int) -> None:
    for prefix in (V1_DOC_PREFIX, V1_VERSION_PREFIX):
        chunk: list[str] = []
        for key in client.scan_iter(match=prefix + "*", count=1000):
            chunk.append(_s(key)[len(prefix) :])
            if len(chunk) >= batch:
                client.sadd(PENDING_IDS, *chunk)
                chunk = []
        if chunk:
            client.sadd(PENDING_IDS, *chunk)


def _present(client: Any, keys: list[str]) -> bool:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.exists(key)
    return any(pipe.execute())


def _move(client: Any, moves: Iterable[tuple[str, str]]) -> int:
    """DUMP old → RESTORE new (REPLACE) → DEL old for each pair whose old key exists.

    Three round trips, in this order: on a cluster a pipeline's commands to different
    nodes run in no set order, so the deletes wait until every restore has answered."""
    moves = list(moves)
    pipe = client.pipeline(transaction=False)
    for old, _ in moves:
        pipe.dump(old)
    found = [(old, new, p) for (old, new), p in zip(moves, pipe.execute(), strict=True) if p]
    if not found:
        return 0  # moved already (or never existed)
    pipe = client.pipeline(transaction=False)
    for _, new, payload in found:
        pipe.restore(new, 0, payload, replace=True)
    pipe.execute()
    pipe = client.pipeline(transaction=False)
    for old, _, _ in found:
        pipe.delete(old)
    pipe.execute()
    return len(found)


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
