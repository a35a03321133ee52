"""``index retire`` and ``index generations``: the end of a generation and the list of them.

Retire deletes what only a generation has: its logs, snapshot registrations, the
builder's ``lv`` hashes, its ``{gtr}:addrs`` entry and the rollback hold on the serving
generation's logs (so they may be trimmed again); when no other generation that is not
retired has its shard count, also that layout's documents, version counters and writer
gates (the copy a reshard made). Its record stays, ``retired``: the local stack and the
chart stop its shards; its trained index directory is left to whoever made it (the
local stack deletes a retired generation's files under its run dir).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from services.common.errors import FailedPrecondition, RetrievalError
from services.generations.documents import nodes
from services.generations.registry import Generation, Registry
from services.generations.replicas import ReplicaStats, all_stats
from services.index.keys import ADDRESSES_KEY, ALIAS_KEY, Layout

if TYPE_CHECKING:
    from services.rpc.tls import ClientTLS


@dataclass(frozen=True)
class Retired:
    generation: Generation
    keys_deleted: int
    documents_deleted: int  # documents of its layout deleted (0: another generation uses it)


def retire(client: Any, name: str | None = None) -> Retired:
    """Retire ``name`` (default: the previous generation). FailedPrecondition for the
    serving one, one a rollout is using, or no previous one; NotFound for an unknown one."""
    registry = Registry(client)
    alias = registry.alias()
    if name is None:
        if not alias.previous:
            raise FailedPrecondition(
                f"no previous generation to retire ({alias.serving} serves); name one "
                "with --generation"
            )
        name = alias.previous
    gen = registry.get(name)
    if gen.name == alias.serving:
        raise FailedPrecondition(f"{gen.name} is the serving generation: it cannot be retired")
    running = registry.running()
    if running and gen.name in (running.target, running.source):
        raise FailedPrecondition(
            f"a rollout from {running.source} to {running.target} is running: "
            "retire after it (or `index rollout --abort`)"
        )
    base = registry.base_shards()
    keys = gen.keys(base)
    registry.put(replace(gen, state="retired"))
    if alias.previous == gen.name:
        client.hset(ALIAS_KEY, "previous", "")
    deleted = 0
    for shard in range(keys.num_shards):
        deleted += int(client.delete(keys.log(shard)))
        deleted += int(client.delete(keys.snapshots(shard)))
        deleted += int(client.delete(keys.replicas_seen(shard)))
        deleted += int(client.delete(keys.logged(shard)))
    client.hdel(ADDRESSES_KEY, gen.name)
    for other in registry.all():  # its rollback hold on the generations it switched to
        if other.name != gen.name and other.state != "retired":
            okeys = other.keys(base)
            for shard in range(okeys.num_shards):
                client.hdel(okeys.snapshots(shard), f"rollback:{gen.name}")
                client.hdel(okeys.replicas_seen(shard), f"rollback:{gen.name}")
    documents = 0
    shared = any(
        g.num_shards == gen.num_shards and g.state != "retired" and g.name != gen.name
        for g in registry.all()
    )
    if not shared:
        documents = _delete_layout(client, keys.layout)
    return Retired(registry.get(gen.name), deleted, documents)


def _delete_layout(client: Any, layout: Layout) -> int:
    """Delete every document, version counter and writer gate of ``layout``; the number
    of documents."""
    documents = 0
    for node in nodes(client):
        for shard in range(layout.num_shards):
            for prefix in ("doc:", "ver:"):
                keys = list(node.scan_iter(match=f"{prefix}{layout.tag(shard)}:*", count=1000))
                for i in range(0, len(keys), 500):
                    n = _unlink(node, keys[i : i + 500])
                    documents += n if prefix == "doc:" else 0
    for shard in range(layout.num_shards):
        client.delete(layout.gate(shard))
    return documents


def _unlink(node: Any, keys: list[bytes]) -> int:
    pipe = node.pipeline(transaction=False)
    for key in keys:  # one key per command: keys of several slots on a cluster node
        pipe.unlink(key)
    return sum(int(n) for n in pipe.execute())


# --- index generations ---------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    documents: int | None  # vectors the generation's replicas hold (one replica per shard)
    bytes: int | None  # their memory (one replica per shard)
    drift: float | None  # the highest PQ error ratio of its replicas (recent / at training)
    log_entries: int  # entries in its logs (Redis)
    replicas_up: int
    replicas: int


def generation_sizes(
    client: Any,
    gen: Generation,
    base: int,
    spec: str | None,
    timeout: float = 3.0,
    tls: ClientTLS | None = None,
) -> Sizes:
    """Sizes of ``gen`` from its replicas' Stats (``spec``: its addresses; ``tls``: how to
    reach them, the rollout's shard TLS: under `up --tls` they require the run's client
    certificate, and a replica asked without it counts as down) and its logs."""
    keys = gen.keys(base)
    entries = sum(int(client.xlen(keys.log(s))) for s in range(keys.num_shards))
    if not spec or gen.state in ("retired", "failed"):
        return Sizes(None, None, None, entries, 0, 0)

    try:
        stats = asyncio.run(all_stats(spec, tls, timeout=timeout))
    except (RetrievalError, ValueError):
        return Sizes(None, None, None, entries, 0, 0)
    documents = 0
    size = 0
    drift: float | None = None
    up = total = 0
    complete = True
    for replicas in stats:
        answered = [r for r in replicas if isinstance(r, ReplicaStats)]
        total += len(replicas)
        up += len(answered)
        if not answered:
            complete = False
            continue
        best = max(answered, key=lambda r: r.vectors)
        documents += best.vectors
        size += best.memory_bytes
        ratios = [r.pq_error_ratio for r in answered if r.pq_error_ratio == r.pq_error_ratio]
        if ratios:
            drift = max([*ratios, drift or 0.0])
    if not complete:
        return Sizes(None, None, drift, entries, up, total)
    return Sizes(documents, size, drift, entries, up, total)
