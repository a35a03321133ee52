"""BEIR data for training and evaluation: corpus, queries, qrels, split, dense first stage.

The dense first stage is the service's own: the documents' all-MiniLM-L6-v2 embeddings
of ``title + " " + text`` (``corpus.all-MiniLM-L6-v2.npy`` next to the corpus, in
corpus order; computed when absent), queries encoded by the same model, exact inner
product.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.errors import InvalidArgument, NotFound
from services.corpus.readers import read_corpus

log = logging.getLogger(__name__)

EMBEDDINGS_FILE = "corpus.all-MiniLM-L6-v2.npy"


@dataclass(frozen=True)
class BeirData:
    doc_ids: list[str]  # corpus order (the row order of the embeddings file)
    docs: dict[str, str]  # id → title + " " + text
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]  # query id → doc id → relevance (> 0 only)
    root: Path


def doc_text(title: str, text: str) -> str:
    return f"{title} {text}".strip() if title else text


def load_beir(root: Path, split: str = "train") -> BeirData:
    root = Path(root)
    for name in ("corpus.jsonl", "queries.jsonl", f"qrels/{split}.tsv"):
        if not (root / name).exists():
            raise NotFound(f"{root}: missing {name} (a BEIR dataset folder)")
    doc_ids, docs = [], {}
    for doc in read_corpus(root / "corpus.jsonl"):
        doc_ids.append(doc.id)
        docs[doc.id] = doc_text(doc.title, doc.text)
    queries = {}
    with (root / "queries.jsonl").open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                queries[str(row["_id"])] = str(row["text"])
    qrels: dict[str, dict[str, int]] = {}
    with (root / f"qrels/{split}.tsv").open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh):
            parts = line.rstrip("\n").split("\t")
            if lineno == 0 and not parts[-1].lstrip("-").isdigit():
                continue  # header
            qid, did, rel = parts[0], parts[1], int(parts[2])
            if rel > 0 and qid in queries and did in docs:
                qrels.setdefault(qid, {})[did] = rel
    return BeirData(doc_ids, docs, queries, qrels, root)


def split_queries(
    qids: list[str], seed: int, dev_fraction: float = 0.2
) -> tuple[list[str], list[str]]:
    """Deterministic train/dev split: sorted ids shuffled by ``seed``; dev gets the fraction."""
    if not 0.0 < dev_fraction < 1.0:
        raise InvalidArgument("dev_fraction must be in (0, 1)")
    order = sorted(qids)
    random.Random(seed).shuffle(order)
    n_dev = max(1, round(len(order) * dev_fraction))
    return sorted(order[n_dev:]), sorted(order[:n_dev])


def doc_embeddings(data: BeirData, embedder: object | None = None) -> np.ndarray:
    path = data.root / EMBEDDINGS_FILE
    if path.exists():
        emb = np.load(path).astype(np.float32, copy=False)
        if emb.shape[0] != len(data.doc_ids):
            raise InvalidArgument(f"{path}: {emb.shape[0]} rows for {len(data.doc_ids)} docs")
        return emb
    embedder = embedder or _embedder()
    texts = [data.docs[d] for d in data.doc_ids]
    return np.concatenate([embedder.embed(texts[i : i + 64], "document")[0]  # type: ignore[attr-defined]
                           for i in range(0, len(texts), 64)])  # fmt: skip


def _embedder() -> object:
    from services.encoder.model import TorchEmbedder

    return TorchEmbedder()


def dense_run(data: BeirData, qids: list[str], k: int = 100) -> dict[str, list[str]]:
    """Top-``k`` doc ids per query by exact inner product (the dense first stage)."""
    embedder = _embedder()
    docs = doc_embeddings(data, embedder)
    texts = [data.queries[q] for q in qids]
    vecs = np.concatenate([embedder.embed(texts[i : i + 64], "query")[0]  # type: ignore[attr-defined]
                           for i in range(0, len(texts), 64)]) if texts else np.zeros((0, docs.shape[1]))  # noqa: E501  # fmt: skip
    sims = vecs @ docs.T
    k = min(k, docs.shape[0])
    top = np.argpartition(-sims, k - 1, axis=1)[:, :k]
    run = {}
    for row, qid in enumerate(qids):
        best = top[row][np.argsort(-sims[row, top[row]], kind="stable")]
        run[qid] = [data.doc_ids[j] for j in best]
    return run
