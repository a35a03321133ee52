"""BEIR datasets (corpus.jsonl, queries.jsonl, qrels/<split>.tsv): read, and split by query.

Training and evaluation read the same folders through this module; which split a caller
reads is its own choice (trainers read ``train`` only, never a test split).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidArgument, NotFound
from services.corpus.readers import read_corpus


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
