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

Generations (issue #24, docs/generations.md) add, without renaming the keys above (they
are the base layout's and generation g1's): ``{N.s}`` tags for another shard count N,
``:<gen>`` suffixes on the logs and snapshot keys of another generation, the writer gate
``wgen:{s}``, the builder's ``lv:{s}:<gen>`` and the registry under the tag ``{gtr}``
(:class:`Layout`, :class:`GenerationKeys`, :mod:`services.index.records`).

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


# --- generations (issue #24, docs/generations.md) ---------------------------------------
#
# A generation's vectors, logs and snapshots are its own; documents belong to a *layout*
# (a shard count) and are shared by every generation of that shard count. The store's
# first shard count (``gtr:layout`` ``shards``, the *base*) keeps the names above, and the
# first generation, ``g1``, keeps the log names above: a store written before generations
# existed is generation g1 of its base layout, with no key renamed. Another shard count N
# tags its keys ``{N.s}``; another generation suffixes its per-generation keys ``:<gen>``.

FIRST_GENERATION = "g1"
REGISTRY_TAG = "{gtr}"
GENERATIONS_KEY = f"{REGISTRY_TAG}:gens"  # hash: name -> record JSON
ALIAS_KEY = f"{REGISTRY_TAG}:alias"  # hash: serving, epoch, previous
ROLLOUT_KEY = f"{REGISTRY_TAG}:rollout"  # hash: the running rollout's state
NEXT_GENERATION_KEY = f"{REGISTRY_TAG}:next"  # counter of generation numbers
ADDRESSES_KEY = f"{REGISTRY_TAG}:addrs"  # hash: name -> shard addresses (the --shards syntax)
# string: a running rollout's CPU budget (``index rollout --cpus``, a CPU list), with a
# TTL its CLI keeps refreshing; the local stack keeps serving off those CPUs meanwhile
CPU_BUDGET_KEY = f"{REGISTRY_TAG}:cpu-budget"
# string: the generation whose shards the local stack keeps on that budget now ("" none),
# written on each of its passes while a budget holds (short TTL): the builder's switch
# waits until it no longer names the target (services/generations/placement.py)
CPU_PLACED_KEY = f"{REGISTRY_TAG}:cpu-placed"
# string: the target of a rollout whose catch-up does not gain on the writes, with a short
# TTL its builder renews while so: the local stack pauses none of the rollout's processes
# while searches run meanwhile (services/process/hold.py), so that the catch-up can outrun
# the writers at the searches' expense rather than never finish
HOLD_LIFTED_KEY = f"{REGISTRY_TAG}:hold-lifted"
# hash: a gateway's id -> the latency of the searches it answered lately (JSON; the key
# expires unless a gateway writes it again): a rollout's builder paces itself on it
# (services/generations/serving_latency.py)
SEARCH_LATENCY_KEY = f"{REGISTRY_TAG}:search-latency"
CLOSED = "-"  # a layout shard's writer gate while no generation takes its writes


@dataclass(frozen=True)
class Layout:
    """The document keys of a shard count: ``base`` is the store's first one."""

    num_shards: int
    base: int

    def tag(self, shard: int) -> str:
        if self.num_shards == self.base:
            return shard_tag(shard)
        return "{" + f"{self.num_shards}.{shard}" + "}"

    def shard(self, doc_id: str) -> int:
        return shard_of(doc_id, self.num_shards)

    def doc(self, doc_id: str) -> str:
        return f"doc:{self.tag(self.shard(doc_id))}:{doc_id}"

    def version(self, doc_id: str) -> str:
        return f"ver:{self.tag(self.shard(doc_id))}:{doc_id}"

    def doc_prefix(self, shard: int) -> str:
        return f"doc:{self.tag(shard)}:"

    def gate(self, shard: int) -> str:
        """The writer gate of a layout shard: the generation whose log takes its writes
        (absent: g1 on the base layout, closed elsewhere; :data:`CLOSED`: closed)."""
        return f"wgen:{self.tag(shard)}"


@dataclass(frozen=True)
class GenerationKeys:
    """The per-generation keys of generation ``name`` over ``layout``."""

    name: str
    layout: Layout

    @property
    def num_shards(self) -> int:
        return self.layout.num_shards

    def _suffix(self) -> str:
        return "" if self.name == FIRST_GENERATION else f":{self.name}"

    def log(self, shard: int) -> str:
        return f"log:{self.layout.tag(shard)}{self._suffix()}"

    def snapshots(self, shard: int) -> str:
        return f"snap:{self.layout.tag(shard)}{self._suffix()}"

    def replicas_seen(self, shard: int) -> str:
        return f"snapseen:{self.layout.tag(shard)}{self._suffix()}"

    def late_vectors(self, shard: int, target: str) -> str:
        """Hash entry id → the vectors by rollout target ``target``'s encoder of this log's
        entry, when the gateway's dual encode finished after the entry was written
        (services/gateway/dual_write.py); the catch-up reads them instead of encoding
        again. Deleted when the rollout ends; a TTL besides."""
        return f"tvl:{self.layout.tag(shard)}{self._suffix()}:{target}"

    def logged(self, shard: int) -> str:
        """Hash id → the newest version the rollout builder appended to this log (the
        builder's appends are idempotent by it; the gateway's writes do not use it)."""
        return f"lv:{self.layout.tag(shard)}:{self.name}"


def generation_keys(name: str, num_shards: int, base: int) -> GenerationKeys:
    return GenerationKeys(name, Layout(num_shards, base))


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
