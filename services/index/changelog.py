"""The change log in Redis: documents ``doc:{id}`` and one stream ``log:{shard}`` per shard.

Writes (the gateway) put the document hash and its log entry in one transaction, so a
document exists in the store exactly when its upsert is in its shard's log. One stream
entry carries a whole batch for one shard::

    op    "u" (upsert) | "d" (delete)
    ids   JSON list of document ids
    vecs  packed little-endian float32, len(ids) × dim   (upserts)
    dim   dimension                                       (upserts)
    tags  JSON list of {key: value} metadata per id       (upserts)
    ver   the writer's version (ns timestamp) of the batch

The entry ID (``<ms>-<seq>``) is the log position: monotonic per shard, so the order of
a shard's log is the order in which every replica applies it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import numpy as np

from services.index.changes import Change, Delete, Upsert

DOC_PREFIX = "doc:"
LOG_PREFIX = "log:"
SNAPSHOT_POSITIONS = "snap:"  # hash per shard: replica → newest snapshot position


def log_key(shard: int) -> str:
    return f"{LOG_PREFIX}{shard}"


def doc_key(doc_id: str) -> str:
    return f"{DOC_PREFIX}{doc_id}"


def encode_upserts(
    ids: Sequence[str], vectors: np.ndarray, tags: Sequence[dict[str, str]]
) -> dict[str, bytes | str]:
    vecs = np.ascontiguousarray(vectors, dtype="<f4")
    return {
        "op": "u",
        "ids": json.dumps(list(ids)),
        "vecs": vecs.tobytes(),
        "dim": str(vecs.shape[1]),
        "tags": json.dumps(list(tags)),
        "ver": str(time.time_ns()),
    }


def encode_deletes(ids: Sequence[str]) -> dict[str, bytes | str]:
    return {"op": "d", "ids": json.dumps(list(ids)), "ver": str(time.time_ns())}


def decode_entry(fields: dict[bytes, bytes]) -> list[Change]:
    op = fields[b"op"]
    ids = json.loads(fields[b"ids"])
    if op == b"d":
        return [Delete(doc_id) for doc_id in ids]
    dim = int(fields[b"dim"])
    vectors = np.frombuffer(fields[b"vecs"], dtype="<f4").reshape(len(ids), dim)
    tags = json.loads(fields[b"tags"])
    version = int(fields.get(b"ver", b"0"))
    return [Upsert(doc_id, vectors[i], tags[i], version) for i, doc_id in enumerate(ids)]
