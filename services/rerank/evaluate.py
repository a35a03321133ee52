"""Rerank the dense first stage on the dev queries and report nDCG@10.

The dev queries are the ones the trainer held out (``split.json`` in the checkpoint);
all checkpoints compared must have been trained on the same split. Reranking re-orders
the dense top-``depth``; documents below ``depth`` keep their dense order after it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import InvalidArgument, NotFound
from services.rerank.checkpoint import load_checkpoint
from services.rerank.data import dense_run, load_beir, ndcg_at_k
from services.rerank.scorer import CeliScorer


@dataclass(frozen=True)
class EvalConfig:
    data_dir: Path
    checkpoints: tuple[Path, ...]
    depth: int = 100
    max_queries: int | None = None  # first N dev queries (sorted ids), to cap CPU time
    batch_size: int = 16
    k: int = 10


def dev_queries(checkpoints: tuple[Path, ...]) -> list[str]:
    splits = []
    for ckpt in checkpoints:
        path = Path(ckpt) / "split.json"
        if not path.exists():
            raise NotFound(f"{path}: the checkpoint has no trainer split")
        splits.append(json.loads(path.read_text())["dev"])
    if any(s != splits[0] for s in splits):
        raise InvalidArgument("the checkpoints were trained on different splits (seed/fraction)")
    return list(splits[0])


def evaluate(cfg: EvalConfig, progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    data = load_beir(cfg.data_dir)
    qids = dev_queries(cfg.checkpoints)
    if cfg.max_queries is not None:
        qids = qids[: cfg.max_queries]
    run = dense_run(data, qids, k=max(cfg.depth, cfg.k))
    report: dict[str, Any] = {
        "queries": len(qids), "depth": cfg.depth, "k": cfg.k,
        "ndcg@10": {"dense": _mean_ndcg(run, data.qrels, cfg.k)},
        "seconds": {}, "pairs_per_s": {},
    }  # fmt: skip
    for ckpt in cfg.checkpoints:
        model, tokenizer, config = load_checkpoint(ckpt)
        scorer = CeliScorer(model, tokenizer, config, config.variant, cfg.batch_size)
        label = f"+{config.variant} ({Path(ckpt).name})"
        reranked, start = {}, time.perf_counter()
        for qid in tqdm(qids, desc=label, disable=not progress):
            head, tail = run[qid][: cfg.depth], run[qid][cfg.depth :]
            scores = scorer.score(data.queries[qid], [data.docs[d] for d in head])
            order = np.argsort(-scores, kind="stable")
            reranked[qid] = [head[i] for i in order] + tail
        seconds = time.perf_counter() - start
        report["ndcg@10"][label] = _mean_ndcg(reranked, data.qrels, cfg.k)
        report["seconds"][label] = round(seconds, 1)
        report["pairs_per_s"][label] = round(len(qids) * cfg.depth / seconds, 1)
    return report


def _mean_ndcg(run: dict[str, list[str]], qrels: dict[str, dict[str, int]], k: int) -> float:
    return round(float(np.mean([ndcg_at_k(run[q], qrels[q], k) for q in run])), 4)
