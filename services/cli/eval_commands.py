"""``gtr-retrieval eval``: nDCG@10, Recall@100, MRR@10 of exact search, IVF-PQ, BM25,
hybrid and rerank; trained encoders against the base (``--encoder``)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from services.cli.common import config_from_args
from services.cli.encoder_train_commands import add_encoder_eval_args, run_encoder_eval

DESCRIPTION = """\
Evaluate retrieval quality on a BEIR folder (corpus.jsonl, queries.jsonl,
qrels/<split>.tsv) with ir-measures: nDCG@10, Recall@100 and MRR@10 of exact search,
of IVF-PQ at the default nprobe (the one `index train` tunes) and at other nprobe
values, and of IVF-PQ + CELI rerank (with --rerank-checkpoint, on the queries the
checkpoint held out of training), side by side; then, on the dev queries (those the
checkpoint held out, else the rerank trainer's default dev fifth), BM25 (the shards'
Tantivy text index), dense and hybrid (RRF and weighted fusion; + CELI with
--rerank-checkpoint) with paired 95 % intervals against dense; plus the encoder's
contrastive entropy (Fang et al., SIGIR 2024). --encoder compares trained checkpoints
with the base model instead. By default everything runs in this process with
the service's index code and no servers; --gateway evaluates a running stack
instead (the corpus is upserted first). Embeddings are cached in
$GTR_CACHE_DIR (default ~/.cache/gtr-retrieval) by model and content; a
corpus.<model>.npy beside the corpus is used as is. The last line printed is JSON.
"""

EPILOG = """\
examples:
  gtr-retrieval eval --data ../shared/data/scifact
  gtr-retrieval eval --data ../shared/data/scifact --rerank-checkpoint ckpt/celi
  gtr-retrieval eval --data ../shared/data/scifact --gateway 127.0.0.1:50051 --nprobe 32
  gtr-retrieval eval --data ../shared/data/scifact --encoder ckpt/sde --encoder ckpt/ade-spl
"""


def add_cli(sub: Any) -> None:
    p = sub.add_parser(
        "eval",
        help="Retrieval quality on a BEIR folder (exact, IVF-PQ, BM25, hybrid, rerank; "
        "trained encoders).",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", required=True, type=Path, help="BEIR folder.")
    p.add_argument("--split", default="train", help="Qrels split: qrels/<split>.tsv (train).")
    p.add_argument(
        "--nprobe",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="Also evaluate IVF-PQ at this nprobe; repeatable (default: "
        "nlist/16, /8, /4, /2 and nlist in-process, none through a gateway).",
    )
    p.add_argument(
        "--rerank-checkpoint",
        type=Path,
        default=None,
        help="CELI checkpoint (`rerank train --out`); its gain is measured on the "
        "queries of its split.json's dev part. Through --gateway the gateway's "
        "reranker must serve this checkpoint.",
    )
    p.add_argument("--rerank-depth", type=int, default=20, help="Candidates reranked (20).")
    p.add_argument("--max-queries", type=int, default=None, help="Only the first N queries.")
    p.add_argument(
        "--negatives",
        type=int,
        default=256,
        help="Random negatives per pair for the contrastive entropy (256).",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.05,
        help="Similarity temperature of the contrastive entropy (0.05: "
        "all-MiniLM-L6-v2's training scale 20).",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="Where the in-process index is trained (default: a temp dir).",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads.")
    p.add_argument(
        "--gateway",
        default=None,
        metavar="HOST:PORT",
        help="Evaluate through this running gateway instead of in-process.",
    )
    p.add_argument(
        "--no-ingest",
        action="store_true",
        help="--gateway: the corpus is already ingested; do not upsert it.",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="--gateway: seconds per search.")
    p.add_argument(
        "--token",
        default=None,
        help="--gateway: bearer token (default: $GTR_TOKEN; the local stack's).",
    )
    p.add_argument("--tls-ca", default=None, help="--gateway: PEM CA (TLS; $GTR_TLS_CA).")
    p.add_argument("--tls-client-cert", default=None, help="--gateway: mTLS client cert.")
    p.add_argument("--tls-client-key", default=None, help="--gateway: its key.")
    p.add_argument("--quiet", action="store_true", help="No progress bars; table and JSON only.")
    add_encoder_eval_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.encoder:
        return run_encoder_eval(args)
    from gtr_client import ApiError
    from services.common.errors import RetrievalError
    from services.eval.config import EvalConfig
    from services.eval.report import json_line, table
    from services.eval.run import evaluate

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(
        EvalConfig,
        args,
        data_dir=args.data,
        nprobes=tuple(args.nprobe),
        progress=not args.quiet,
        ingest=not args.no_ingest,
        timeout_s=args.timeout,
    )
    try:
        if cfg.gateway:
            from services.client.gateway import ingest_file, resolve_gateway

            gateway = resolve_gateway(args)
            ingest = None
            if cfg.ingest:
                corpus = str(Path(cfg.data_dir) / "corpus.jsonl")

                def ingest() -> int:
                    return ingest_file(gateway, corpus, progress=cfg.progress)

            report = evaluate(cfg, gateway.client, ingest)
        else:
            report = evaluate(cfg)
    except RetrievalError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except ApiError as exc:
        print(f"error: {exc.code}: {exc.details}", file=sys.stderr)
        return 1
    print(table(report))
    print(json_line(report), flush=True)
    return 0
