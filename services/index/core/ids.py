"""Stable ids: which shard a document lives on, and its 63-bit FAISS id.

Both are hashes of the caller's string id (blake2b with distinct personalisation), so
every gateway and every shard agrees without coordination. A 63-bit id collides with
probability ~n²/2⁶⁴ (about 3·10⁻⁸ at a million documents per shard); a collision is
detected when applied (a different string id already holds the FAISS id) and logged as
an error, and the newer document replaces the older one in the index (the document store
keeps both; the older one can no longer be found by vector search).
"""

from __future__ import annotations

import hashlib

_ID_MASK = (1 << 63) - 1


def faiss_id(doc_id: str) -> int:
    digest = hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8, person=b"gtr-fid").digest()
    return int.from_bytes(digest, "little") & _ID_MASK


def shard_of(doc_id: str, num_shards: int) -> int:
    if num_shards <= 0:
        raise ValueError("num_shards must be positive")
    digest = hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8, person=b"gtr-shd").digest()
    return int.from_bytes(digest, "little") % num_shards
