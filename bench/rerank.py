"""Reranker throughput: CELI vs monoBERT on the same backbone, and ms per query by depth.

    .venv/bin/python -m bench.rerank [--checkpoint DIR] [--threads 2] [--repeats 3]
        [--out bench/results/rerank_depths.json]

Candidates are SciFact documents (``title + " " + text``, the service's max length 256)
with a SciFact query, so the lengths are realistic; without the data, synthetic
~200-word documents are used. The depth table (``{"ms_per_query_at_depth": {...}}``)
is what the gateway's ``--rerank-depth-table`` reads; ``depth_for_budget(budget_ms,
table)`` (re-exported from ``services.rerank.depths``) picks the depth that fits a
budget. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.rerank.depths import depth_for_budget, load_depth_table

__all__ = ["depth_for_budget", "load_depth_table", "main"]

DEPTHS = (10, 20, 50, 100)
BUDGETS_MS = (250, 500, 1000, 2000)
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "scifact"


def _texts(data_dir: Path, n: int) -> tuple[str, list[str]]:
    if (data_dir / "corpus.jsonl").exists():
        from services.corpus.beir import load_beir

        data = load_beir(data_dir)
        qid = sorted(data.qrels)[0]
        return data.queries[qid], [data.docs[d] for d in data.doc_ids[:n]]
    words = [
        "protein",
        "cell",
        "expression",
        "gene",
        "cancer",
        "patients",
        "study",
        "results",
        "increased",
    ]
    return "what protein drives cancer", [" ".join(words * 22)] * n


def _scorers(checkpoint: str | None, batch_size: int) -> dict[str, Any]:
    """CELI (the checkpoint, or an untrained head) and monoBERT on the same backbone."""
    from services.rerank.checkpoint import build_model, load_or_default
    from services.rerank.serve.scorer import CeliScorer

    celi, tok, cfg = load_or_default(Path(checkpoint) if checkpoint else None)
    mono_cfg = replace(cfg, variant="monobert")
    mono, _ = build_model(_backbone_dir(checkpoint), mono_cfg)
    mono.backbone.load_state_dict(celi.backbone.state_dict())
    return {
        "celi": CeliScorer(celi, tok, cfg, "celi", batch_size),
        "monobert": CeliScorer(mono.eval(), tok, mono_cfg, "monobert", batch_size),
    }


def _backbone_dir(checkpoint: str | None) -> Path:
    from services.rerank.checkpoint import BACKBONE_DIR, default_backbone_dir

    return Path(checkpoint) / BACKBONE_DIR if checkpoint else default_backbone_dir()


def _time(scorer: Any, query: str, docs: list[str], repeats: int) -> float:
    """Median seconds of scoring ``docs`` (after one warm-up call)."""
    return _interleaved({"x": scorer}, query, docs, repeats)["x"]


def _interleaved(
    scorers: dict[str, Any], query: str, docs: list[str], repeats: int
) -> dict[str, float]:
    """Median seconds per scorer, runs alternated (A B A B …) so that load from other
    processes on a shared machine hits every scorer alike."""
    for scorer in scorers.values():
        scorer.score(query, docs[: min(8, len(docs))])
    runs: dict[str, list[float]] = {name: [] for name in scorers}
    for _ in range(repeats):
        for name, scorer in scorers.items():
            start = time.perf_counter()
            scorer.score(query, docs)
            runs[name].append(time.perf_counter() - start)
    return {name: statistics.median(r) for name, r in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--checkpoint", help="Rerank checkpoint (default: untrained CELI head).")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="SciFact BEIR folder.")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results/rerank_depths.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    query, docs = _texts(Path(args.data), max(DEPTHS))
    scorers = _scorers(args.checkpoint, args.batch_size)
    seconds = _interleaved(scorers, query, docs, args.repeats)
    pairs_per_s = {name: round(len(docs) / s, 1) for name, s in seconds.items()}
    depths = {
        str(d): round(1000 * _time(scorers["celi"], query, docs[:d], args.repeats), 1)
        for d in DEPTHS
    }
    tokens = scorers["celi"].pairs.encode(query, docs)[0]
    result = {
        "bench": "rerank",
        "threads": args.threads,
        "batch_size": args.batch_size,
        "candidates": len(docs),
        "mean_pair_tokens": round(sum(map(len, tokens)) / len(tokens), 1),
        "max_len": scorers["celi"].config.max_len,
        "celi_pairs_per_s": pairs_per_s["celi"],
        "monobert_pairs_per_s": pairs_per_s["monobert"],
        "celi_cost_ratio": round(seconds["celi"] / seconds["monobert"], 3),
        "ms_per_query_at_depth": depths,
        "depth_for_budget_ms": {
            str(b): depth_for_budget(b, {int(d): ms for d, ms in depths.items()})
            for b in BUDGETS_MS
        },
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"ms_per_query_at_depth": depths, "source": result}, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
