"""What one ``gtr-retrieval eval`` run evaluates."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.index.core.train import TrainOptions
from services.measures.entropy import NEGATIVES, TEMPERATURE

DEPTH = 100  # hits per query: Recall@100 needs 100
RERANK_DEPTH = 20  # first-stage candidates the reranker re-orders


@dataclass(frozen=True)
class EvalConfig:
    data_dir: Path
    split: str = "train"  # qrels/<split>.tsv
    # extra nprobe values besides the trained default; () = nlist/16, /8, /4, /2 and nlist
    nprobes: tuple[int, ...] = ()
    rerank_checkpoint: Path | None = None
    rerank_depth: int = RERANK_DEPTH
    rerank_batch_size: int = 16
    max_queries: int | None = None  # the first N queries (sorted ids), to bound CPU time
    negatives: int = NEGATIVES
    temperature: float = TEMPERATURE
    run_dir: Path | None = None  # where the index is trained; None: a temporary directory
    train: TrainOptions = field(default_factory=TrainOptions)
    threads: int | None = None  # torch threads for encoding and rerank
    cache_dir: Path | None = None  # embedding cache; None: $GTR_CACHE_DIR or ~/.cache/...
    progress: bool = True
    gateway: str | None = None  # evaluate through this running gateway instead
    ingest: bool = True  # --gateway: upsert the corpus first
    timeout_s: float = 30.0  # --gateway: deadline of one search
