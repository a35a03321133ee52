"""A small store for rollout tests: g1 serving two shards of documents written by the real
writer, and an encoder stand-in whose vector of a text is a hash of it (deterministic and
cheap: a test knows which vector each document must get; Triton is not the subject)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from services.common.encoder_spec import EncoderSpec
from services.encoder.base import Embeddings, Encoder
from services.generations.encoding import embedding_text
from services.generations.registry import Registry
from services.index.client.connection import StoreConnection
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.keys import LAYOUT_KEY, GenerationKeys, Layout
from services.process.redis_client import sync_client

DIM = 16
SPEC = EncoderSpec("embed", 1, DIM, "hash-v1", "hash")
G1 = GenerationKeys("g1", Layout(2, 2))
G2 = GenerationKeys("g2", Layout(2, 2))


def vector(text: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


class HashEncoder(Encoder):
    """The vector of a text is a hash of it: deterministic, and cheap."""

    model_name = "hash"
    dim = DIM
    max_batch = 8

    async def encode(self, texts: Sequence[str], kind: Any, timeout: float | None = None) -> Any:
        return Embeddings(np.stack([vector(t) for t in texts]), [False] * len(texts))

    async def close(self) -> None:
        return None


async def hash_encoders(spec: EncoderSpec) -> Encoder:
    return HashEncoder()


def doc(i: int, tag: str = "") -> DocRecord:
    return DocRecord(
        f"d{i}", vector(f"stored {i}"), title=f"title {i}", text=f"body {i} {tag}", metadata={}
    )


async def write_async(
    url: str,
    keys: GenerationKeys,
    upserts: list[DocRecord],
    deletes: Sequence[str] = (),
    *,
    dim: int = DIM,
    batch: int = 16,
) -> None:
    """Write through the real writer into ``keys``' generation, ``batch`` upserts a call
    (the rollout tests of another dimension use it too)."""
    writer = ChangeLogWriter(StoreConnection(url, keys.layout.base), dim, keys=keys)
    try:
        for i in range(0, len(upserts), batch):
            await writer.upsert(upserts[i : i + batch])
        if deletes:
            await writer.delete(list(deletes))
    finally:
        await writer.connection.close()


def write(
    url: str, keys: GenerationKeys, upserts: list[DocRecord], deletes: Sequence[str] = ()
) -> None:
    """Write through the real writer into ``keys``' generation."""
    asyncio.run(write_async(url, keys, upserts, deletes))


def expected(record: DocRecord) -> tuple[float, ...]:
    """The vector a rollout must give ``record``: its embedding text's, through the encoder."""
    return tuple(round(float(x), 4) for x in vector(embedding_text(record.title, record.text)))


def g1_store(redis_url: str, root: Path, docs: int = 60) -> Any:
    """g1 serving two shards (its index recorded as trained with 4-bit PQ, so that a small
    sample trains a target) and ``docs`` documents; a client of it."""
    client = sync_client(redis_url)
    client.hset(LAYOUT_KEY, mapping={"version": "2", "shards": "2"})
    (root / "g1").mkdir()
    (root / "g1" / "manifest.json").write_text(json.dumps({"pq_bits": 4, "refine": False}))
    Registry(client).ensure_first(2, SPEC, str(root / "g1"))
    write(redis_url, G1, [doc(i) for i in range(docs)])
    return client
