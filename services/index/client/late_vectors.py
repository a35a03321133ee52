"""A dual encode that ended after its upsert was written: its vectors kept beside the log.

The gateway's dual write (services/gateway/dual_write.py) logs an upsert with the rollout
target's vectors when their encode ends within its bound. One that ends later used to be
thrown away, and the rollout's catch-up encoded the document again on the target's
encoder (the same work twice on the busiest process of a rollout). Now the gateway keeps
it: per source shard a hash, :meth:`GenerationKeys.late_vectors`, entry id → the entry's
rows by the target's encoder (``<f4``, the entry's documents in its order), which the
catch-up reads for an entry logged without them (services/generations/phase_catch_up.py).

An upsert's documents of one shard are one log entry, in the order the upsert named them
(the writer's script), so the rows of shard ``s`` are the upsert's rows of the documents
``layout.shard`` puts there, in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.common.domain import WriteToken
from services.common.errors import Unavailable
from services.index.client.connection import REDIS_ERRORS, StoreConnection
from services.index.keys import GenerationKeys

# A backstop only: the rollout deletes its hashes when it ends (switch, abort); a builder
# gone for good leaves them to this TTL, renewed on every write.
LATE_TTL_S = 24 * 3600


def rows_by_entry(
    keys: GenerationKeys, token: WriteToken, ids: Sequence[str], vectors: np.ndarray
) -> dict[int, tuple[str, bytes]]:
    """Per shard of ``token`` (an upsert's shard → its log entry): (the entry id, the rows
    of ``vectors`` of the upsert's documents on that shard, packed as the log packs
    ``tvecs``)."""
    rows = np.ascontiguousarray(vectors, dtype="<f4")
    out: dict[int, tuple[str, bytes]] = {}
    for shard, entry in token.items():
        mine = [n for n, doc_id in enumerate(ids) if keys.layout.shard(doc_id) == shard]
        out[shard] = (entry, rows[mine].tobytes())
    return out


def unpack(raw: bytes | None, documents: int, dim: int) -> np.ndarray | None:
    """An entry's kept rows (None: none kept, or not ``documents`` rows of ``dim``; a
    ``dim`` of 0, unknown, is read off their length)."""
    if raw is None or not documents or not raw:
        return None
    dim = dim if dim > 0 else len(raw) // (4 * documents)
    if not dim or len(raw) != documents * dim * 4:
        return None
    rows = np.frombuffer(raw, dtype="<f4").reshape(documents, dim)
    return rows if np.isfinite(rows).all() else None


async def keep(
    connection: StoreConnection,
    keys: GenerationKeys,
    target: str,
    token: WriteToken,
    ids: Sequence[str],
    vectors: np.ndarray,
) -> None:
    """Keep ``vectors`` (by rollout target ``target``'s encoder) of the upsert of ``ids``
    that ``token`` acknowledged, for the catch-up: one HSET and EXPIRE per shard (each
    shard's hash in that shard's slot, a cluster too). Unavailable when Redis fails."""
    try:
        async with connection.slot():
            for shard, (entry, packed) in rows_by_entry(keys, token, ids, vectors).items():
                key = keys.late_vectors(shard, target)
                async with connection.redis.pipeline(transaction=False) as pipe:
                    pipe.hset(key, entry, packed)
                    pipe.expire(key, LATE_TTL_S)
                    await pipe.execute()
    except REDIS_ERRORS as exc:
        raise Unavailable(f"redis: {exc}") from exc
