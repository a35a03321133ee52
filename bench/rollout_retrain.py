"""What ``index rollout --retrain`` costs in recall: the new generation is trained and
filled with the vectors the serving shards *hold* (``ExportVectors``: decoded from their
SQ8 refine codes, 1 byte per dimension, within half a quantization step of the encoder's
vector), not with the encoder's own vectors (docs/generations.md, "The rollout").

In this process, with the service's own training and shard code on a BEIR folder
(default SciFact, its cached all-MiniLM-L6-v2 embeddings):

- ``exact``: IVF-PQ trained on the encoder's vectors and filled with them (a new encoder's
  rollout, or a fresh ``index train``): the baseline, measured in the same run;
- ``retrain``: the SQ8 codec trained on the same vectors (as the serving index's refine
  codec), every vector encoded and decoded by it, then IVF-PQ trained on and filled with
  the decoded vectors: what ``--retrain`` builds;

both searched as a shard serves (IVF-PQ candidates re-ranked by SQ8, the tuned nprobe)
with the same queries; plus each one's 10-recall@10 against exact search on the
encoder's vectors. Last line JSON: nDCG@10 of both, their difference, and the recalls.

Usage: ``python -m bench.rollout_retrain [--data ../shared/data/scifact] [--split train]``
(about a minute on 2 cores with the embeddings cached).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import faiss
import numpy as np

SHARED = Path(
    os.environ.get("GTR_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data")
)


def sq8_round_trip(vectors: np.ndarray) -> np.ndarray:
    """``vectors`` through an SQ8 codec trained on them (what a shard's refine codes keep)."""
    codec = faiss.IndexScalarQuantizer(vectors.shape[1], faiss.ScalarQuantizer.QT_8bit)
    codec.train(vectors)
    codes = codec.sa_encode(vectors)
    return np.asarray(codec.sa_decode(codes), dtype=np.float32)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from services.eval.config import EvalConfig
    from services.eval.data import load
    from services.eval.inprocess import build_shard, exact_run, shard_run
    from services.measures.ranking import score

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=SHARED / "scifact")
    parser.add_argument("--split", default="train")
    args = parser.parse_args(argv)

    cfg = EvalConfig(data_dir=args.data, split=args.split, progress=False)
    data = load(cfg)
    decoded = sq8_round_trip(data.doc_vectors)
    error = np.linalg.norm(decoded - data.doc_vectors, axis=1)
    truth = exact_run(data, 10)
    out: dict[str, Any] = {
        "data": str(args.data),
        "split": args.split,
        "documents": len(data.beir.doc_ids),
        "queries": len(data.qids),
        "sq8_error_l2_mean": round(float(error.mean()), 5),
        "sq8_error_l2_max": round(float(error.max()), 5),
        "cosine_to_encoder_min": round(
            float(
                (np.sum(decoded * data.doc_vectors, axis=1) / np.linalg.norm(decoded, axis=1)).min()
            ),
            5,
        ),
    }
    for name, vectors in (("exact", data.doc_vectors), ("retrain", decoded)):
        with tempfile.TemporaryDirectory(prefix=f"gtr-retrain-{name}-") as work:
            shard, manifest = build_shard(
                replace(data, doc_vectors=vectors), cfg, Path(work) / "index"
            )
            run = shard_run(shard, data, 0)
        ndcg = score(run, data.beir.qrels, data.qids).mean("ndcg_at_10")
        recall = np.mean(
            [
                len(set(run[q][:10]) & set(truth[q][:10])) / max(1, len(truth[q][:10]))
                for q in data.qids
            ]
        )
        out[f"{name}_ndcg_at_10"] = round(float(ndcg), 4)
        out[f"{name}_recall_at_10_vs_exact"] = round(float(recall), 4)
        out[f"{name}_nprobe"] = manifest.nprobe
        print(
            f"{name:8s} nDCG@10 {ndcg:.4f}  10-recall@10 vs exact {recall:.4f}  "
            f"(nlist {manifest.nlist}, nprobe {manifest.nprobe})",
            flush=True,
        )
    out["retrain_minus_exact_ndcg"] = round(out["retrain_ndcg_at_10"] - out["exact_ndcg_at_10"], 4)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
