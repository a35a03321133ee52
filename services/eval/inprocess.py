"""The systems of an evaluation, in this process with the service's own index code.

- ``exact``: ``IndexFlatIP`` over the document embeddings (the reference);
- ``ivfpq_default``: the corpus's IVF-PQ index trained with ``index train``'s defaults
  (:func:`services.index.core.train.train_index`, the nprobe it tunes) and searched by
  :class:`IvfPqShard` as a shard serves it (IVF-PQ candidates re-ranked by SQ8);
- ``ivfpq_nprobe_<n>``: the same index at other nprobe values;
- ``ivfpq_default+rerank``: the CELI checkpoint's order of the top ``rerank_depth`` of
  ``ivfpq_default``, on the queries the checkpoint was *not* trained on (its
  ``split.json``: the gain is measured on held-out queries only).
- ``bm25``: the same shard's Tantivy text index (:mod:`services.index.core.text`) over
  title + text, as a shard serves sparse searches;
- ``hybrid_rrf`` / ``hybrid_weighted``: ``ivfpq_default`` and ``bm25`` (top 100 each)
  fused by :mod:`services.common.fusion` as the gateway fuses them (RRF k 60; min-max
  normalised scores, dense weight 0.5), and ``hybrid_weighted+rerank`` (the default
  fusion) beside ``ivfpq_default+rerank`` (CELI over the fused candidates).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import faiss

from services.common.errors import InvalidArgument, NotFound
from services.common.fusion import Fusion, Method, fuse
from services.corpus.beir import split_queries
from services.eval.config import DEPTH, EvalConfig
from services.eval.data import EvalData
from services.index.core.changes import Upsert
from services.index.core.shard import MAX_QUERIES, IvfPqShard
from services.index.core.text import TextIndex
from services.index.core.train import train_index
from services.index.core.trained import Manifest, TrainedIndex

Run = dict[str, list[str]]
ScoredRun = dict[str, list[tuple[str, float]]]
# services.rerank.train.trainer.TrainConfig's split (not imported: it pulls in torch)
DEV_SEED = 13
DEV_FRACTION = 0.2
FUSIONS = {"hybrid_rrf": Fusion(Method.RRF), "hybrid_weighted": Fusion(Method.WEIGHTED)}


@dataclass
class Systems:
    """Every system's run over the evaluated queries, and what describes them."""

    runs: dict[str, Run] = field(default_factory=dict)
    index: dict[str, Any] = field(default_factory=dict)  # factory, nlist, nprobe, ...
    rerank: dict[str, Any] = field(default_factory=dict)  # checkpoint, depth, queries, ...
    seconds: dict[str, float] = field(default_factory=dict)
    dev: list[str] = field(default_factory=list)  # the queries hybrid is chosen on


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def exact_run(data: EvalData, depth: int = DEPTH) -> Run:
    flat = faiss.IndexFlatIP(data.doc_vectors.shape[1])
    flat.add(data.doc_vectors)
    _, rows = flat.search(data.query_vectors, min(depth, len(data.beir.doc_ids)))
    ids = data.beir.doc_ids
    return {q: [ids[j] for j in row if j >= 0] for q, row in zip(data.qids, rows, strict=True)}


def sweep_nprobes(nlist: int, default: int, extra: tuple[int, ...]) -> list[int]:
    """The nprobe values besides the default: ``extra``, else nlist/16, /8, /4, /2, nlist."""
    for n in extra:
        if not 1 <= n <= nlist:
            raise InvalidArgument(f"nprobe {n} must be in 1..nlist ({nlist})")
    chosen = extra or tuple(max(1, nlist // d) for d in (16, 8, 4, 2, 1))
    return sorted(set(chosen) - {default})


def build_shard(data: EvalData, cfg: EvalConfig, index_dir: Path) -> tuple[IvfPqShard, Manifest]:
    """Train an index on the documents into ``index_dir`` (the defaults) and add them all."""
    options = replace(cfg.train, model=data.model)
    manifest = train_index(data.doc_vectors, index_dir, options)
    text = TextIndex.create(index_dir.parent / "text")
    shard = IvfPqShard(TrainedIndex.load(index_dir), text)
    ids = data.beir.doc_ids
    docs = data.beir.docs
    for i in range(0, len(ids), 10_000):
        rows = range(i, min(i + 10_000, len(ids)))
        changes = [Upsert(ids[j], data.doc_vectors[j], body=docs[ids[j]]) for j in rows]
        shard.apply(changes, f"1-{rows.stop}")
    return shard, manifest


def shard_run(shard: IvfPqShard, data: EvalData, nprobe: int, depth: int = DEPTH) -> Run:
    run: Run = {}
    k = min(depth, len(data.beir.doc_ids))
    for i in range(0, len(data.qids), MAX_QUERIES):
        rows = shard.search(data.query_vectors[i : i + MAX_QUERIES], k, nprobe)
        for q, row in zip(data.qids[i : i + MAX_QUERIES], rows, strict=True):
            run[q] = [doc_id for doc_id, _ in row]
    return run


def scored_run(shard: IvfPqShard, data: EvalData, sparse: bool, depth: int = DEPTH) -> ScoredRun:
    """Per query its (doc id, score) hits: the default dense search, or BM25."""
    run: ScoredRun = {}
    k = min(depth, len(data.beir.doc_ids))
    for i in range(0, len(data.qids), MAX_QUERIES):
        qids = data.qids[i : i + MAX_QUERIES]
        if sparse:
            terms = shard.query_terms([data.beir.queries[q] for q in qids])
            rows = shard.search_text(terms, k).hits()
        else:
            rows = shard.search(data.query_vectors[i : i + MAX_QUERIES], k, 0)
        run.update(zip(qids, rows, strict=True))
    return run


def fused_run(dense: ScoredRun, sparse: ScoredRun, fusion: Fusion, depth: int = DEPTH) -> Run:
    return {q: [f.id for f in fuse(dense[q], sparse[q], fusion, depth)] for q in dense}


def dev_queries(cfg: EvalConfig, qids: list[str]) -> list[str]:
    """The queries a hybrid choice is made on: those the CELI checkpoint kept out of its
    training (``split.json``), else the rerank trainer's default dev split of the same
    data (seed 13, a fifth), so that no reranker trained with the defaults saw them."""
    if cfg.rerank_checkpoint is not None:
        return held_out_queries(Path(cfg.rerank_checkpoint), qids)
    _, dev = split_queries(sorted(qids), DEV_SEED, DEV_FRACTION)
    held = set(dev)
    return [q for q in qids if q in held]


def held_out_queries(checkpoint: Path, qids: list[str]) -> list[str]:
    """The evaluated queries the checkpoint's trainer kept out of training (``split.json``);
    InvalidArgument when there are none (no fair rerank gain to measure)."""
    path = Path(checkpoint) / "split.json"
    if not path.exists():
        raise NotFound(
            f"{path}: the checkpoint has no trainer split (split.json), so its "
            "gain could not be measured on queries it was not trained on"
        )
    split = json.loads(path.read_text())
    dev = set(split.get("dev", []))
    if not dev:
        raise InvalidArgument(f"{path} lists no held-out (dev) queries")
    held = [q for q in qids if q in dev]
    if not held:
        raise InvalidArgument(
            "none of the evaluated queries was held out of the "
            "checkpoint's training: no fair rerank gain to measure"
        )
    return held


def rerank_run(first: Run, data: EvalData, qids: list[str], cfg: EvalConfig) -> Run:
    """CELI's order of the first ``rerank_depth`` hits; the rest keep their order after them
    (:func:`services.eval.rerank.rerank_runs`, the loop ``rerank evaluate`` uses too)."""
    from services.eval.rerank import rerank_runs
    from services.rerank.checkpoint import load_checkpoint
    from services.rerank.serve.scorer import CeliScorer

    assert cfg.rerank_checkpoint is not None
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    model, tokenizer, config = load_checkpoint(Path(cfg.rerank_checkpoint))
    scorer = CeliScorer(model, tokenizer, config, config.variant, cfg.rerank_batch_size)
    beir = data.beir
    label = f"rerank top {cfg.rerank_depth}"
    runs = rerank_runs(
        scorer,
        first,
        beir.queries,
        beir.docs,
        qids,
        cfg.rerank_depth,
        label=label,
        progress=cfg.progress,
    )
    return runs["score"]


def evaluate_in_process(data: EvalData, cfg: EvalConfig) -> Systems:
    out = Systems()
    start = time.perf_counter()
    out.runs["exact"] = exact_run(data)
    out.seconds["exact"] = time.perf_counter() - start
    with tempfile.TemporaryDirectory(prefix="gtr-eval-") as tmp:
        index_dir = (Path(cfg.run_dir) / "index") if cfg.run_dir else Path(tmp) / "index"
        start = time.perf_counter()
        shard, manifest = build_shard(data, cfg, index_dir)
        out.seconds["train_and_add"] = time.perf_counter() - start
        out.index = {
            "factory": manifest.factory,
            "nlist": manifest.nlist,
            "nprobe_default": manifest.nprobe,
            "target_recall": manifest.target_recall,
            "measured_recall_at_10": _round(manifest.measured_recall),
            "measured_wide_recall": _round(manifest.measured_wide_recall),
            "wide_k": manifest.wide_k,
            "ivf_advice": manifest.ivf_advice,
        }
        start = time.perf_counter()
        out.runs["ivfpq_default"] = shard_run(shard, data, 0)
        out.seconds["ivfpq_default"] = time.perf_counter() - start
        start = time.perf_counter()
        dense = scored_run(shard, data, sparse=False)
        sparse = scored_run(shard, data, sparse=True)
        out.seconds["bm25"] = time.perf_counter() - start
        out.runs["bm25"] = {q: [d for d, _ in hits] for q, hits in sparse.items()}
        for name, fusion in FUSIONS.items():
            out.runs[name] = fused_run(dense, sparse, fusion)
        text_stats = shard.stats().text
        if text_stats is not None and text_stats.disk_bytes is not None:
            out.index["text_bytes_per_document"] = round(
                text_stats.disk_bytes / max(1, text_stats.documents), 1
            )
        for nprobe in sweep_nprobes(manifest.nlist, manifest.nprobe, cfg.nprobes):
            out.runs[f"ivfpq_nprobe_{nprobe}"] = shard_run(shard, data, nprobe)
    out.dev = dev_queries(cfg, data.qids)
    if cfg.rerank_checkpoint is not None:
        held = held_out_queries(Path(cfg.rerank_checkpoint), data.qids)
        start = time.perf_counter()
        out.runs["ivfpq_default+rerank"] = rerank_run(out.runs["ivfpq_default"], data, held, cfg)
        out.runs["hybrid_weighted+rerank"] = rerank_run(
            out.runs["hybrid_weighted"], data, held, cfg
        )
        out.seconds["rerank"] = time.perf_counter() - start
        out.rerank = {
            "checkpoint": str(cfg.rerank_checkpoint),
            "depth": cfg.rerank_depth,
            "queries": held,
        }
    return out
