"""The dense first stage over a BEIR dataset, for training and evaluating the reranker.

The dense first stage is the service's own: the documents' all-MiniLM-L6-v2 embeddings
of ``title + " " + text`` (``corpus.all-MiniLM-L6-v2.npy`` next to the corpus, in
corpus order; computed when absent), queries encoded by the same model, exact inner
product.
"""

from __future__ import annotations

import logging

import numpy as np

from services.common.errors import InvalidArgument
from services.corpus.beir import BeirData

log = logging.getLogger(__name__)

EMBEDDINGS_FILE = "corpus.all-MiniLM-L6-v2.npy"


def doc_embeddings(data: BeirData, embedder: object | None = None) -> np.ndarray:
    path = data.root / EMBEDDINGS_FILE
    if path.exists():
        emb = np.load(path).astype(np.float32, copy=False)
        if emb.shape[0] != len(data.doc_ids):
            raise InvalidArgument(f"{path}: {emb.shape[0]} rows for {len(data.doc_ids)} docs")
        return emb
    embedder = embedder or _embedder()
    texts = [data.docs[d] for d in data.doc_ids]
    return np.concatenate(
        [
            embedder.embed(texts[i : i + 64], "document")[0]  # type: ignore[attr-defined]
            for i in range(0, len(texts), 64)
        ]
    )


def _embedder() -> object:
    from services.encoder.model import TorchEmbedder

    return TorchEmbedder()


def dense_run(data: BeirData, qids: list[str], k: int = 100) -> dict[str, list[str]]:
    """Top-``k`` doc ids per query by exact inner product (the dense first stage)."""
    embedder = _embedder()
    docs = doc_embeddings(data, embedder)
    texts = [data.queries[q] for q in qids]
    vecs = (
        np.concatenate(
            [
                embedder.embed(texts[i : i + 64], "query")[0]  # type: ignore[attr-defined]
                for i in range(0, len(texts), 64)
            ]
        )
        if texts
        else np.zeros((0, docs.shape[1]))
    )
    sims = vecs @ docs.T
    k = min(k, docs.shape[0])
    top = np.argpartition(-sims, k - 1, axis=1)[:, :k]
    run = {}
    for row, qid in enumerate(qids):
        best = top[row][np.argsort(-sims[row, top[row]], kind="stable")]
        run[qid] = [data.doc_ids[j] for j in best]
    return run
