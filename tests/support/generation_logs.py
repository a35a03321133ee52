"""A generation's change logs in tests: a store to write them in (recorded as two shards
of layout version 2), and reading them back: every change in log order, and the state
they fold to (what a replica that applied them holds)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from services.index.changelog import decode_entry
from services.index.core.changes import Upsert
from services.index.keys import LAYOUT_KEY, GenerationKeys
from services.process.redis_client import sync_client


@contextmanager
def two_shard_store(redis_url: str) -> Iterator[Any]:
    """A client of the Redis at ``redis_url`` with its store recorded as two shards of
    layout version 2 (what the first generation, g1, is created over); closed on exit."""
    client = sync_client(redis_url)
    client.hset(LAYOUT_KEY, mapping={"version": "2", "shards": "2"})
    try:
        yield client
    finally:
        client.close()


def changes(client: Any, keys: GenerationKeys) -> list[tuple[str, str, int]]:
    """(id, "u" | "d", version) of every change in ``keys``' logs, shard by shard, in order."""
    out: list[tuple[str, str, int]] = []
    for shard in range(keys.num_shards):
        for _, fields in client.xrange(keys.log(shard)):
            for change in decode_entry(fields):
                op = "u" if isinstance(change, Upsert) else "d"
                out.append((change.doc_id, op, change.version))
    return out


def folded(client: Any, keys: GenerationKeys) -> dict[str, tuple[int, str, tuple[float, ...]]]:
    """id → (version, body, vector rounded to 4 places) of every document the logs leave
    alive (a later delete removes it, as a replica applying them would)."""
    state: dict[str, tuple[int, str, tuple[float, ...]]] = {}
    for shard in range(keys.num_shards):
        for _, fields in client.xrange(keys.log(shard)):
            for change in decode_entry(fields):
                if isinstance(change, Upsert):
                    vec = tuple(round(float(x), 4) for x in change.vector)
                    state[change.doc_id] = (change.version, change.body, vec)
                else:
                    state.pop(change.doc_id, None)
    return state
