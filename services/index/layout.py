"""The key layout version recorded in Redis, checked by every service at start.

A store written by this code says so in ``gtr:layout`` (``version`` 2 and the shard
count its document keys were computed with). A service that finds the keys of layout 1
(``log:<s>``, no hash tags), an unfinished migration, a newer layout or another shard
count refuses to start with a message that says what to do, instead of serving a store
it would misread: every document key depends on the shard count.
"""

from __future__ import annotations

from typing import Any

from services.common.errors import FailedPrecondition, NotFound
from services.index.keys import (
    FIRST_GENERATION,
    GENERATIONS_KEY,
    LAYOUT_KEY,
    LAYOUT_VERSION,
    v1_shard_keys,
)
from services.index.records import RUNNING, get_generation


def migrate_hint(num_shards: int) -> str:
    return (
        f"stop the gateway and the shards, then run `gtr-retrieval redis migrate "
        f"--redis-url <url> --shards {num_shards}`"
    )


def read_layout(client: Any) -> dict[str, str]:
    raw = client.hgetall(LAYOUT_KEY)
    return {_s(k): _s(v) for k, v in raw.items()}


def v1_keys_present(client: Any, num_shards: int) -> list[str]:
    """The layout-1 shard keys (logs, snapshot registrations) that exist."""
    names = [old for s in range(num_shards) for old in v1_shard_keys(s)]
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.exists(name)
    return [name for name, n in zip(names, pipe.execute(), strict=True) if n]


def check_layout(client: Any, num_shards: int, generation: str = FIRST_GENERATION) -> int:
    """Return the store's base shard count when it has this code's layout (recording it
    in an empty store); FailedPrecondition otherwise. ``client`` is a blocking Redis or
    RedisCluster.

    ``generation``: whom the caller serves. g1 (the default, and every gateway) must have
    the base shard count. Another generation (a shard of a rollout's target, issue #24)
    must be in the registry (``{gtr}:gens``) with ``num_shards`` shards, which may differ
    from the base (a reshard), and the store must exist already (its base is recorded)."""
    layout = read_layout(client)
    if not layout and generation != FIRST_GENERATION:
        raise FailedPrecondition(
            f"generation {generation}: the store has no key layout yet (gtr:layout); "
            "generation g1's gateway or shards record it"
        )
    if not layout:
        old = v1_keys_present(client, num_shards)
        if old:
            raise FailedPrecondition(
                f"Redis holds the key layout of version 1 ({', '.join(old[:3])}...), this "
                f"code reads version {LAYOUT_VERSION}: {migrate_hint(num_shards)}"
            )
        client.hsetnx(LAYOUT_KEY, "version", str(LAYOUT_VERSION))
        client.hsetnx(LAYOUT_KEY, "shards", str(num_shards))
        layout = read_layout(client)
    version = int(layout.get("version", "1"))
    if "migrating" in layout:
        raise FailedPrecondition(
            f"a migration of the Redis key layout to version {layout['migrating']} did not "
            f"finish: run it again (`gtr-retrieval redis migrate --redis-url <url> "
            f"--shards {layout.get('shards', num_shards)}`)"
        )
    if version > LAYOUT_VERSION:
        raise FailedPrecondition(
            f"Redis holds the key layout of version {version}, newer than this code's "
            f"({LAYOUT_VERSION}): upgrade the services"
        )
    if version < LAYOUT_VERSION:
        raise FailedPrecondition(
            f"Redis holds the key layout of version {version}, this code reads version "
            f"{LAYOUT_VERSION}: {migrate_hint(num_shards)}"
        )
    shards = int(layout.get("shards", num_shards))
    if generation != FIRST_GENERATION:
        check_generation(client, generation, num_shards)
        return shards
    if shards != num_shards:
        raise FailedPrecondition(
            f"the document store was written for {shards} shards, this service is "
            f"configured for {num_shards}: documents are keyed by their shard, so the "
            "shard count of a store changes by a rollout to a generation of another "
            "shard count (`gtr-retrieval index rollout --shards N`, docs/generations.md)"
        )
    return shards


def check_generation(client: Any, generation: str, num_shards: int) -> None:
    """FailedPrecondition unless the registry has ``generation`` with ``num_shards``
    shards in a state whose shards run."""
    try:
        record = get_generation(client, generation)
    except NotFound:
        raise FailedPrecondition(
            f"generation {generation} is not in the registry ({GENERATIONS_KEY}): a "
            "rollout creates it (`gtr-retrieval index generations` lists them)"
        ) from None
    if record.num_shards != num_shards:
        raise FailedPrecondition(
            f"generation {generation} has {record.num_shards} shards, this service is "
            f"configured for {num_shards}"
        )
    if record.state not in RUNNING:
        raise FailedPrecondition(
            f"generation {generation} is {record.state}: its shards no longer run"
        )


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def check_layout_at(
    url: str, num_shards: int, wait_s: float = 60.0, generation: str = FIRST_GENERATION
) -> None:
    """:func:`check_layout` (of ``generation``) on the Redis (or Redis Cluster) of
    ``url``; while it cannot be reached (a pod starting before Redis), tried again for up
    to ``wait_s``, then Unavailable (:func:`services.process.redis_client.with_sync_client`)."""
    from services.process.redis_client import with_sync_client

    with_sync_client(
        url,
        lambda client: check_layout(client, num_shards, generation),
        to="check its key layout",
        wait_s=wait_s,
    )
