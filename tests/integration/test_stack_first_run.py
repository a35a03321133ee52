"""The first ``up`` on a run directory encodes the corpus once: training samples the
embeddings it made, and the documents are stored with those same vectors (no second
encode), readable by a real gateway and shards on a real Redis.

The in-process encoder stands in for Triton here (``up --encoder inprocess``): the path
through Triton is the same code with another :class:`Encoder`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

import gtr_client
from services.common.domain import Document
from services.encoder.runtime.inprocess import InProcessEncoder
from services.index.core.trained import Manifest
from services.stack import first_run
from services.stack.config import StackConfig
from tests.support.background import stack_in_background
from tests.support.processes import run_redis

N_DOCS = 300


def small_corpus(scifact_dir: Path, path: Path) -> list[dict[str, str]]:
    rows = []
    with (scifact_dir / "corpus.jsonl").open(encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            rows.append({"_id": row["_id"], "title": row["title"], "text": row["text"][:300]})
            if len(rows) == N_DOCS:
                break
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return rows


@pytest.mark.slow  # encodes 300 documents twice over and starts a gateway: > 30 s
def test_the_first_run_encodes_once_trains_and_stores_the_same_vectors(
    scifact_dir: Path, tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    rows = small_corpus(scifact_dir, corpus)
    cfg = StackConfig(
        run_dir=tmp_path / "run",
        corpus=corpus,
        shards=2,
        encoder="inprocess",
        train_sample=N_DOCS,
        progress=False,
    )
    said: list[str] = []
    emb = first_run.encode_corpus(cfg, corpus, "", said.append)
    assert emb.vectors.shape == (N_DOCS, 384) and [d.id for d in emb.docs] == [
        r["_id"] for r in rows
    ]
    assert any(f"encoding the {N_DOCS} documents" in s for s in said)

    # the vectors are the ones the gateway's upsert computes: "title text", document side
    encoder = InProcessEncoder.torch()
    try:
        texts = [Document(r["_id"], r["text"], r["title"]).embedding_text for r in rows[:5]]
        expected = asyncio.run(encoder.encode(texts, "document")).vectors
    finally:
        asyncio.run(encoder.close())
    np.testing.assert_allclose(emb.vectors[:5], expected, atol=1e-5)

    manifest = first_run.train_on(cfg, emb, said.append)
    assert Manifest.read(cfg.index_dir).train_points == N_DOCS == manifest.train_points

    with run_redis(tmp_path / "redis") as store:
        assert first_run.store_documents(store.url, cfg.shards, emb, progress=False) == N_DOCS
        with stack_in_background(store.url, cfg.index_dir, tmp_path, shards=2) as bg:
            with gtr_client.Client(bg.address, env=False) as client:
                for r in rows[:: N_DOCS // 6]:
                    hits = client.search(r["title"], k=3, timeout=60).hits
                    assert hits and hits[0].id == r["_id"], r["title"]
                    assert hits[0].title == r["title"] and hits[0].text == r["text"]
