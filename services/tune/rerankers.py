"""CELI rerankers for a tuning run: trained on the first stage they serve behind, then
scored once over every validation and dev query's candidates.

``hybrid`` (the recipe of issue #35): hard negatives sampled from the chosen first
stage's top ``depth`` (the fused list, so the dense-only, sparse-only and both-lists
candidates come in the mixture fusion produces), the depth it will rerank at most.
``dense``: today's ``rerank train`` recipe (negatives from all-MiniLM-L6-v2's exact dense
top 50), kept for the comparison. Both train on the train split only (validation and dev
held out), with ``rerank train``'s defaults otherwise, and resume from their last
checkpoint (every 100 steps) when a run is restarted.

Scoring: CELI's score of each of the top ``depth`` candidates of every validation and dev
query, in one pass; every rerank depth and weight is then a re-sort of those numbers.
Written to ``<out>/scores/<name>.json`` every 25 queries, so a restart scores only the rest.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.corpus.beir import BeirData
from services.encoder.serve.versions import write_atomically
from services.tune.config import TuneConfig
from services.tune.lists import Run

log = logging.getLogger(__name__)
TODAY_NEGATIVE_DEPTH = 50  # rerank train's default
SAVE_EVERY = 25


def trained_steps(ckpt: Path) -> int:
    path = ckpt / "celi_config.json"
    if not path.exists():
        return 0
    return int(json.loads(path.read_text()).get("training", {}).get("step", 0))


def train_reranker(
    cfg: TuneConfig, source: str, holdout: Sequence[str], negatives_file: Path | None, out: Path
) -> dict[str, Any]:
    """Train (or resume, or find done) one reranker into ``out``; its record."""
    done = trained_steps(out)
    record: dict[str, Any] = {
        "checkpoint": str(out),
        "negatives": source,
        "negatives_file": None if negatives_file is None else str(negatives_file),
        "negative_depth": cfg.depth if source == "hybrid" else TODAY_NEGATIVE_DEPTH,
        "steps": cfg.rerank_steps,
        "max_len": cfg.rerank_max_len,
        "seed": cfg.seed,
    }
    if done < cfg.rerank_steps:
        _train(cfg, record, holdout, negatives_file, out, done)
    training = json.loads((out / "celi_config.json").read_text()).get("training", {})
    record["loss_first_50"] = training.get("loss_first_50")
    record["loss_last_50"] = training.get("loss_last_50")
    record["train_seconds_last_run"] = training.get("seconds_this_run")  # the trainer's own
    return record


def _train(
    cfg: TuneConfig,
    record: dict[str, Any],
    holdout: Sequence[str],
    negatives_file: Path | None,
    out: Path,
    done: int,
) -> None:
    from services.rerank.train.trainer import TrainConfig, train

    train(
        TrainConfig(
            data_dir=Path(cfg.data_dir),
            out=out,
            backbone=cfg.rerank_backbone,
            steps=cfg.rerank_steps,
            max_len=cfg.rerank_max_len,
            negative_depth=int(record["negative_depth"]),
            negatives_file=negatives_file,
            holdout=tuple(holdout),
            seed=cfg.seed,
            dev_fraction=cfg.dev_fraction,
            resume=done > 0,
            progress=cfg.progress,
        )
    )


def score_candidates(
    ckpt: Path,
    beir: BeirData,
    first: Run,
    qids: Sequence[str],
    depth: int,
    path: Path,
    progress: bool,
) -> dict[str, dict[str, float]]:
    """CELI's score of each of the top ``depth`` of ``first[q]`` for every ``q`` in
    ``qids``: ``{q: {doc id: score}}``, resumed from ``path`` and saved to it."""
    from tqdm import tqdm

    from services.rerank.checkpoint import load_checkpoint
    from services.rerank.serve.scorer import CeliScorer

    scores: dict[str, dict[str, float]] = json.loads(path.read_text()) if path.exists() else {}
    todo = [q for q in qids if q not in scores]
    if not todo:
        return scores
    model, tokenizer, config = load_checkpoint(ckpt)
    scorer = CeliScorer(model, tokenizer, config, config.variant)
    path.parent.mkdir(parents=True, exist_ok=True)
    for n, q in enumerate(tqdm(todo, desc=f"score {ckpt.name}", disable=not progress), 1):
        head = first[q][:depth]
        values = scorer.score(beir.queries[q], [beir.docs[d] for d in head]) if head else None
        scores[q] = (
            {} if values is None else {d: float(v) for d, v in zip(head, values, strict=True)}
        )
        if n % SAVE_EVERY == 0 or n == len(todo):
            write_atomically(path, json.dumps(scores))
    return scores
