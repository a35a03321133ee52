"""``gtr-retrieval encoder train`` and ``gtr-retrieval eval --encoder``: the dual-encoder
trainer (``services/encoder/train/``) and its comparison with the base checkpoint.

``add_train(commands)`` registers the sub-command on the ``encoder`` group;
``add_encoder_eval_args(p)`` and ``run_encoder_eval(args)`` are ``eval --encoder``.
Heavy imports (torch, transformers) happen inside the handlers, never at import time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from services.cli.common import add_command, config_from_args, positive_int, run_handler

ARCH_CHOICES = ("sde", "ade", "ade-ste", "ade-fte", "ade-spl")

DESCRIPTION = """\
Fine-tune a sentence-transformers / GTR checkpoint as a dual encoder with in-batch
sampled softmax (GTR §3) plus hard negatives mined once with the base checkpoint
(judged positives excluded). --arch (Dong et al. 2022):
  sde      Siamese: one tower for queries and documents
  ade      asymmetric: two towers, both initialised from the checkpoint
  ade-ste  ADE whose towers share the token embeddings
  ade-fte  ADE whose token embeddings are frozen
  ade-spl  ADE whose towers share the projection layer after pooling; a checkpoint
           without a Dense layer (all-MiniLM-L6-v2) gets a shared d x d projection
           initialised to the identity
The judged queries of qrels/train.tsv are split by query into train and dev (--seed,
--dev-fraction; recorded in the manifest); no other split is read. --out gets
manifest.json, training.png (loss, dev nDCG@10) and the checkpoint: for sde --out is
one sentence-transformers checkpoint, otherwise --out/query and --out/document are.
`encoder export --model-dir DIR` and `encoder repo` turn it into a Triton repository
(docs/encoder.md).
"""

EPILOG = """\
example (SciFact, 2 CPU cores; docs/encoder.md):
  gtr-retrieval encoder train --data ../shared/data/scifact --arch ade-spl \\
      --out ckpt/ade-spl --threads 2
  gtr-retrieval eval --data ../shared/data/scifact --encoder ckpt/sde --encoder ckpt/ade-spl
"""


def _ranks(text: str) -> tuple[int, int]:
    try:
        first, last = (int(v) for v in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not FIRST-LAST, e.g. 4-20") from None
    if not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= FIRST <= LAST")
    return first, last


def add_train(commands: Any) -> argparse.ArgumentParser:
    p = add_command(
        commands,
        "train",
        _train,
        help="fine-tune the dual encoder (sde, ade, ade-ste, ade-fte, ade-spl) on BEIR",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--data", required=True, help="BEIR folder (corpus.jsonl, queries.jsonl, qrels/train.tsv)"
    )
    p.add_argument("--arch", required=True, choices=ARCH_CHOICES, help="architecture")
    p.add_argument("--out", required=True, help="checkpoint folder to write (must not hold one)")
    p.add_argument(
        "--model-dir",
        help="base sentence-transformers / GTR checkpoint (default: the packaged all-MiniLM-L6-v2)",
    )
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the train pairs (1)")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=16,
        help="pairs per optimizer step; the softmax runs over the batch (16)",
    )
    p.add_argument(
        "--micro-batch",
        type=positive_int,
        help="gradient accumulation: encode this many pairs at a time and keep the "
        "softmax over the whole --batch-size (GradCache; one extra forward pass)",
    )
    p.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate (2e-5)")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.05,
        help="softmax temperature (0.05 = scale 20, all-MiniLM-L6-v2's own)",
    )
    p.add_argument(
        "--negatives",
        type=int,
        default=1,
        help="mined hard negatives per pair (1; 0: in-batch negatives only)",
    )
    p.add_argument(
        "--negative-ranks",
        type=_ranks,
        default=(4, 20),
        metavar="FIRST-LAST",
        help="mine from the base model's exact ranks FIRST..LAST (4-20)",
    )
    p.add_argument("--max-query-len", type=positive_int, default=64, help="tokens (64)")
    p.add_argument("--max-doc-len", type=positive_int, default=192, help="tokens (192)")
    p.add_argument("--seed", type=int, default=13, help="split, order and sampling seed (13)")
    p.add_argument("--dev-fraction", type=float, default=0.2, help="dev share of queries (0.2)")
    p.add_argument(
        "--eval-every",
        type=int,
        default=16,
        help="dev nDCG@10 on a pool (the base top --dev-pool-depth of each dev "
        "query plus its judged documents) every N steps (16; 0: never)",
    )
    p.add_argument("--dev-pool-depth", type=positive_int, default=5, help="(5)")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="also save a resumable checkpoint every N steps (0: at the end only)",
    )
    p.add_argument(
        "--stop-after", type=positive_int, help="stop after this step with a resumable checkpoint"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue --out from its trainer_state.pt (same arch and recipe)",
    )
    p.add_argument(
        "--index-dir",
        help="the serving index's folder: refuse a checkpoint "
        "whose width differs from the index's (it would need a new index)",
    )
    p.add_argument(
        "--no-final-eval",
        action="store_true",
        help="skip the exact dev evaluation over the corpus at the end",
    )
    p.add_argument(
        "--eval-doc-len",
        type=positive_int,
        help="documents' tokens in that evaluation (default: the serving limit, "
        "256 for MiniLM; fewer to save CPU, the same for every system compared)",
    )
    p.add_argument(
        "--eval-corpus",
        type=positive_int,
        help="evaluate on this many documents (the dev queries' judged ones plus a seeded "
        "sample of the rest) instead of the whole corpus: a CPU budget cut, comparable "
        "only with figures of the same sample",
    )
    p.add_argument("--threads", type=positive_int, help="torch threads (torch.set_num_threads)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _train(args: argparse.Namespace) -> int:
    from services.encoder.train.trainer import TrainConfig, train

    first, last = args.negative_ranks
    cfg = config_from_args(
        TrainConfig,
        args,
        data_dir=Path(args.data),
        out=Path(args.out),
        base=Path(args.model_dir) if args.model_dir else None,
        negative_skip=first - 1,
        negative_depth=last,
        index_dir=Path(args.index_dir) if args.index_dir else None,
        final_eval=not args.no_final_eval,
        progress=not args.quiet,
    )
    manifest = train(cfg).manifest
    print(
        json.dumps(
            {
                "out": args.out,
                "arch": manifest["arch"],
                "steps": manifest["steps"],
                "complete": manifest["complete"],
                "dev": manifest["dev"],
                "timing": manifest["timing"],
            }
        )
    )
    return 0


def add_encoder_eval_args(p: argparse.ArgumentParser) -> None:
    """``eval --encoder DIR ...`` and its options (on the eval parser)."""
    p.add_argument(
        "--encoder",
        action="append",
        default=[],
        type=Path,
        metavar="DIR",
        help="Checkpoint of `encoder train` (repeatable): compare the base checkpoint and "
        "each one on their dev split (exact search): nDCG@10 with the paired bootstrap 95%% "
        "interval of its difference to the base, Recall@100, MRR@10, contrastive entropy, "
        "and how separable query and document vectors are (linear probe accuracy; a t-SNE "
        "PNG per system with --plots).",
    )
    p.add_argument("--plots", type=Path, default=None, help="--encoder: write the PNGs here.")
    p.add_argument(
        "--doc-len",
        type=positive_int,
        default=None,
        help="--encoder: documents' tokens (default: what the trainers used).",
    )
    p.add_argument("--out", type=Path, default=None, help="--encoder: also write the JSON here.")


def run_encoder_eval(args: argparse.Namespace) -> int:
    return run_handler(_encoder_eval, args)


def _encoder_eval(args: argparse.Namespace) -> int:
    from services.encoder.train.evaluate import compare, table

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = compare(
        args.data,
        list(args.encoder),
        plots=args.plots,
        doc_len=args.doc_len,
        progress=not args.quiet,
    )
    line = json.dumps(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(line, flush=True)
    return 0
