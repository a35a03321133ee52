"""One encoder's first-stage lists over every judged query, in process with the shard's
own index code (what a shard serves, without the RPCs).

- ``dense``: the corpus's IVF-PQ index trained with ``index train``'s defaults and
  searched at the nprobe it tunes, candidates re-ranked by SQ8, as a shard serves them
  (:func:`services.eval.inprocess.build_shard`);
- ``sparse``: the same shard's Tantivy BM25 over title + text;
- ``exact``: exact inner product over the same vectors (the index's ceiling).

The lists are written to ``<out>/lists/<name>.json`` and read back when a run resumes.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.corpus.beir import BeirData
from services.encoder.serve.versions import write_atomically

log = logging.getLogger(__name__)

Run = dict[str, list[str]]
ScoredRun = dict[str, list[tuple[str, float]]]


@dataclass
class Lists:
    dense: ScoredRun
    sparse: ScoredRun
    exact: Run
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "dense": {q: [[d, round(s, 6)] for d, s in v] for q, v in self.dense.items()},
                "sparse": {q: [[d, round(s, 6)] for d, s in v] for q, v in self.sparse.items()},
                "exact": self.exact,
                "info": self.info,
            }
        )

    @classmethod
    def read(cls, path: Path) -> Lists:
        raw = json.loads(path.read_text())
        return cls(
            {q: [(d, float(s)) for d, s in v] for q, v in raw["dense"].items()},
            {q: [(d, float(s)) for d, s in v] for q, v in raw["sparse"].items()},
            {q: list(v) for q, v in raw["exact"].items()},
            dict(raw["info"]),
        )


def build_lists(
    beir: BeirData,
    encoder_dir: Path | None,
    qids: list[str],
    depth: int,
    work: Path,
    progress: bool,
) -> Lists:
    """Embed the corpus and ``qids`` with the checkpoint (cached), index them as a shard
    does, and take each query's top ``depth`` of the three lists."""
    from services.encoder.embeddings import embed_cached
    from services.encoder.model import default_model_dir, tower_dirs
    from services.encoder.train.data import LazyEncoder, corpus_vectors
    from services.eval.config import EvalConfig
    from services.eval.data import EvalData
    from services.eval.inprocess import build_shard, exact_run, scored_run

    model_dir = Path(encoder_dir) if encoder_dir is not None else default_model_dir()
    start = time.perf_counter()
    dirs = tower_dirs(model_dir)  # a two-tower checkpoint: query/ and document/
    q_encode = LazyEncoder(dirs["query"])
    d_encode = q_encode if dirs["document"] == dirs["query"] else LazyEncoder(dirs["document"])
    key = q_encode.key()
    docs = corpus_vectors(beir, d_encode.key(), d_encode, progress)
    queries = embed_cached(
        [beir.queries[q] for q in qids],
        "query",
        key,
        q_encode,  # type: ignore[arg-type]
        progress=progress,
    )
    data = EvalData(beir, list(qids), key, docs, queries)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        shard, manifest = build_shard(
            data, EvalConfig(data_dir=beir.root, progress=progress), work / "index"
        )
        dense = scored_run(shard, data, sparse=False, depth=depth)
        sparse = scored_run(shard, data, sparse=True, depth=depth)
        if shard.text is not None:
            shard.text.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = {
        "model": key,
        "checkpoint": str(model_dir),
        "factory": manifest.factory,
        "nlist": manifest.nlist,
        "nprobe": manifest.nprobe,
        "seconds": round(time.perf_counter() - start, 1),
    }
    return Lists(dense, sparse, exact_run(data, depth), info)


def lists_for(
    name: str,
    beir: BeirData,
    encoder_dir: Path | None,
    qids: list[str],
    depth: int,
    out: Path,
    progress: bool,
) -> Lists:
    """:func:`build_lists` once: ``<out>/lists/<name>.json`` when a resumed run has it."""
    path = out / "lists" / f"{name}.json"
    if path.exists():
        return Lists.read(path)
    log.info("tune: first-stage lists of %s", name)
    lists = build_lists(beir, encoder_dir, qids, depth, out / "work" / name, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lists.to_json())
    return lists
