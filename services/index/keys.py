"""Where the document store and the change logs live in Redis: the key layout.

Every key of a shard carries the hash tag ``{s}`` (s = the shard number), so on a Redis
Cluster a shard's documents, their version counters, its log and its replica
registrations share one hash slot, and the Lua scripts that write a document together
with its log entry stay in one slot. On a single Redis the tags mean nothing. The shard of
a document is ``shard_of(id, num_shards)`` (:mod:`services.index.core.ids`), so whoever
knows the shard count (the gateway, every shard) computes the same keys.

====================  ============================================================
``doc:{s}:<id>``      hash: ``title``, ``text``, ``meta`` (JSON), ``ver``
``ver:{s}:<id>``      the document's version counter (INCR; outlives a delete)
``log:{s}``           stream: shard s's change log (entry format: ``changelog.py``)
``snap:{s}``          hash: replica → its replay floor (the log is trimmed below it)
``snapseen:{s}``      hash: replica → unix time of its last registration
``gtr:layout``        hash: ``version`` (:data:`LAYOUT_VERSION`), ``shards``
====================  ============================================================

Layout version 1 (before Redis Cluster) had no tags: ``doc:<id>``, ``ver:<id>``,
``log:<s>``, ``snap:<s>``, ``snapseen:<s>``; ``gtr-retrieval redis migrate`` rewrites
it (:mod:`services.index.migrate`), and the services refuse to start on it
(:mod:`services.index.layout`).

A Redis Cluster spreads the store by index shard: shard s lives on the primary that owns
slot CRC16("s") mod 16384, so a cluster of P primaries needs at least P index shards
(more spreads better) to use all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.index.core.ids import shard_of

LAYOUT_KEY = "gtr:layout"
LAYOUT_VERSION = 2


def shard_tag(shard: int) -> str:
    return "{" + str(shard) + "}"


def log_key(shard: int) -> str:
    return f"log:{shard_tag(shard)}"


def doc_key(shard: int, doc_id: str) -> str:
    return f"doc:{shard_tag(shard)}:{doc_id}"


def version_key(shard: int, doc_id: str) -> str:
    return f"ver:{shard_tag(shard)}:{doc_id}"


def snapshot_positions_key(shard: int) -> str:
    return f"snap:{shard_tag(shard)}"


def replicas_seen_key(shard: int) -> str:
    return f"snapseen:{shard_tag(shard)}"


@dataclass(frozen=True)
class DocKeys:
    """The keys of a document, for a store of ``num_shards`` shards."""

    num_shards: int

    def shard(self, doc_id: str) -> int:
        return shard_of(doc_id, self.num_shards)

    def doc(self, doc_id: str) -> str:
        return doc_key(self.shard(doc_id), doc_id)

    def version(self, doc_id: str) -> str:
        return version_key(self.shard(doc_id), doc_id)


# --- layout version 1 (read by the migration and by the check at start) ----------------

V1_DOC_PREFIX = "doc:"
V1_VERSION_PREFIX = "ver:"


def v1_shard_keys(shard: int) -> dict[str, str]:
    """Version 1's per-shard keys → their version 2 names."""
    return {
        f"log:{shard}": log_key(shard),
        f"snap:{shard}": snapshot_positions_key(shard),
        f"snapseen:{shard}": replicas_seen_key(shard),
    }
