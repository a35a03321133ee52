"""Rerank a first-stage run with a CELI checkpoint: the one loop, and ``rerank evaluate``.

:func:`rerank_runs` is the evaluation's rerank loop, used by both ``gtr-retrieval rerank
evaluate`` (:func:`evaluate`: checkpoints compared on the dense first stage) and
``gtr-retrieval eval`` (:func:`services.eval.inprocess.rerank_run`: the IVF-PQ first stage).

``rerank evaluate`` reranks the dense first stage on the dev queries and reports nDCG@10.

The dev queries are the ones the trainer held out (``split.json`` in the checkpoint);
all checkpoints compared must have been trained on the same split. Reranking re-orders
the dense top-``depth``; documents below ``depth`` keep their dense order after it.
For CELI the report also gives nDCG@10 of ``s_m`` alone and ``s_l`` alone, and
``untrained=True`` adds the untrained default head (the backbone's zero-shot MaxSim).
``vs_dense`` compares each reranker with the dense order query by query (wins,
losses, mean difference, its bootstrap 95 % interval and the paired t-test). nDCG@10 is
computed by ``ir-measures`` (:mod:`services.measures.ranking`), as ``gtr-retrieval eval`` does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import InvalidArgument, NotFound
from services.corpus.beir import BeirData, load_beir, split_queries
from services.measures.ranking import Run, paired_comparison, score
from services.rerank.checkpoint import CONFIG_FILE, CeliConfig, load_or_default
from services.rerank.serve.scorer import CeliScorer
from services.rerank.train.data import dense_run

TERMS = ("score", "s_m", "s_l")  # CELI's final score and its two terms


def rerank_runs(
    scorer: CeliScorer,
    first: Run,
    queries: Mapping[str, str],
    docs: Mapping[str, str],
    qids: Sequence[str],
    depth: int,
    *,
    label: str = "rerank",
    progress: bool = True,
) -> dict[str, dict[str, list[str]]]:
    """The first ``depth`` documents of ``first[qid]`` in the order of each CELI term
    (:data:`TERMS`); the documents below ``depth`` keep their first-stage order after them.

    ``queries`` and ``docs`` map ids to texts. The three orders come from one scoring pass
    (:meth:`CeliScorer.score_terms`), so asking for ``s_m``/``s_l`` costs nothing extra.
    """
    from tqdm import tqdm

    out: dict[str, dict[str, list[str]]] = {name: {} for name in TERMS}
    for qid in tqdm(qids, desc=label, disable=not progress):
        head, tail = list(first[qid][:depth]), list(first[qid][depth:])
        if not head:
            for ranking in out.values():
                ranking[qid] = []
            continue
        terms = scorer.score_terms(queries[qid], [docs[d] for d in head])
        for name, ranking in out.items():
            order = np.argsort(-terms[name], kind="stable")
            ranking[qid] = [head[i] for i in order] + tail
    return out


@dataclass(frozen=True)
class CheckpointEvalConfig:
    data_dir: Path
    checkpoints: tuple[Path, ...]
    depth: int = 100
    max_queries: int | None = None  # first N dev queries (sorted ids), to cap CPU time
    batch_size: int = 16
    k: int = 10
    untrained: bool = False  # also the untrained default head (zero-shot MaxSim) as a row
    seed: int = 13  # without checkpoints: the trainer's split for this seed / fraction
    dev_fraction: float = 0.2
    max_len: int = 256  # the untrained row's pair length when there is no checkpoint


def dev_queries(cfg: CheckpointEvalConfig, data: BeirData) -> list[str]:
    """The dev ids of the checkpoints' ``split.json`` (all must agree); without
    checkpoints, the trainer's split recomputed from ``seed`` and ``dev_fraction``."""
    if not cfg.checkpoints:
        qids = sorted(q for q in data.qrels if data.qrels[q])
        return split_queries(qids, cfg.seed, cfg.dev_fraction)[1]
    splits = []
    for ckpt in cfg.checkpoints:
        path = Path(ckpt) / "split.json"
        if not path.exists():
            raise NotFound(f"{path}: the checkpoint has no trainer split")
        splits.append(json.loads(path.read_text())["dev"])
    if any(s != splits[0] for s in splits):
        raise InvalidArgument("the checkpoints were trained on different splits (seed/fraction)")
    return list(splits[0])


def evaluate(cfg: CheckpointEvalConfig, progress: bool = True) -> dict[str, Any]:
    if not cfg.checkpoints and not cfg.untrained:
        raise InvalidArgument("nothing to evaluate: give checkpoints and/or untrained")
    ndcg = _ndcg_name(cfg.k)
    data = load_beir(cfg.data_dir)
    qids = dev_queries(cfg, data)
    if cfg.max_queries is not None:
        qids = qids[: cfg.max_queries]
    run = dense_run(data, qids, k=max(cfg.depth, cfg.k))
    dense = score(run, data.qrels, qids)
    report: dict[str, Any] = {
        "queries": len(qids),
        "depth": cfg.depth,
        "k": cfg.k,
        "ndcg@10": {"dense": round(dense.mean(ndcg), 4)},
        "terms": {},
        "vs_dense": {},
        "seconds": {},
        "pairs_per_s": {},
    }
    systems: list[Path | None] = [*cfg.checkpoints, *([None] if cfg.untrained else [])]
    first = (
        CeliConfig.read(Path(cfg.checkpoints[0]) / CONFIG_FILE)
        if cfg.checkpoints
        else CeliConfig(max_len=cfg.max_len)
    )
    same_limits = CeliConfig(
        d_tok=first.d_tok, max_query_len=first.max_query_len, max_len=first.max_len
    )  # the untrained row: same lengths
    for ckpt in systems:
        model, tokenizer, config = load_or_default(ckpt, same_limits)
        scorer = CeliScorer(model, tokenizer, config, config.variant, cfg.batch_size)
        label = f"+{config.variant} ({Path(ckpt).name if ckpt else 'untrained'})"
        start = time.perf_counter()
        reranked = rerank_runs(
            scorer, run, data.queries, data.docs, qids, cfg.depth, label=label, progress=progress
        )
        seconds = time.perf_counter() - start
        rescored = score(reranked["score"], data.qrels, qids)
        report["ndcg@10"][label] = round(rescored.mean(ndcg), 4)
        report["vs_dense"][label] = paired_comparison(dense.values(ndcg), rescored.values(ndcg))
        if config.variant != "monobert":  # the two terms alone, for diagnosis
            for name in ("s_m", "s_l"):
                term = score(reranked[name], data.qrels, qids)
                report["terms"][f"{label} {name} only"] = round(term.mean(ndcg), 4)
        report["seconds"][label] = round(seconds, 1)
        report["pairs_per_s"][label] = round(len(qids) * cfg.depth / seconds, 1)
    return report


def _ndcg_name(k: int) -> str:
    if k != 10:
        raise InvalidArgument(f"nDCG@{k}: the measures are nDCG@10, Recall@100 and MRR@10")
    return "ndcg_at_10"


__all__ = ["TERMS", "CheckpointEvalConfig", "evaluate", "rerank_runs"]
