"""``gtr-retrieval tune``: the whole quality recipe on a BEIR folder (services/tune/)."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

from services.cli.common import add_command, positive_int

NOT_ROLLED_OUT = 3  # --rollout asked, the best system's interval is not above zero

DESCRIPTION = """\
Tune the whole system on a BEIR folder (corpus.jsonl, queries.jsonl, qrels/train.tsv)
and report every system side by side. The judged queries are split into train,
validation and dev (dev: the split every trainer here holds out, --seed and
--dev-fraction; validation: --val-fraction of the rest, held out of all training).
Stages: the serving encoder's first stage (IVF-PQ as a shard serves it, BM25, hybrid);
each --encoder architecture trained (hard negatives from the serving hybrid run or the
base model's dense ranks, --encoder-negatives); each encoder's fusion chosen on the
validation queries; CELI rerankers trained on the best first stage (--reranker hybrid)
or with today's dense-mined recipe (--reranker dense); the rerank depth (within the
latency budget of --size, or --rerank-budget-ms, by the rerank cost table) and the
interpolation weight chosen on the validation queries. The report (<out>/report.json,
the last line printed) gives nDCG@10, Recall@100 and MRR@10 on dev with paired 95 %
intervals against what serves now (the serving encoder, hybrid with the gateway's
default fusion), the ceilings (exact search, every candidate reranked), the recipe,
seeds and time spent; <out>/retrieval_setting.json is the best system's setting, and
<out>/rollout_setting.json the part a generation records (`index rollout --encoder
<its encoder> --retrieval-setting <out>/rollout_setting.json`; its reranker by the
checkpoint's folder name, served by `rerank serve --checkpoint-dir <out>/rerankers`).
Rerunning the same command continues an interrupted run.
"""

EPILOG = """\
examples:
  gtr-retrieval tune --data ../shared/data/scifact --out runs/tune
  gtr-retrieval tune --data ../shared/data/scifact --out runs/tune \\
      --encoder ade-spl --encoder-negatives hybrid --encoder-negatives dense \\
      --reranker hybrid --reranker dense --rerank-budget-ms 6000
"""


def add_cli(sub: Any) -> None:
    p = add_command(
        sub,
        "tune",
        _run,
        help="Train and tune encoder, fusion and reranker together on a BEIR folder; one report.",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", required=True, type=Path, help="BEIR folder with qrels/train.tsv.")
    p.add_argument(
        "--out", required=True, type=Path, help="Run folder (resumed when it holds one)."
    )
    p.add_argument(
        "--encoder",
        action="append",
        default=None,
        metavar="ARCH",
        help="Encoder architecture to train (sde, ade, ade-ste, ade-fte, ade-spl); "
        "repeatable (default: ade-spl).",
    )
    p.add_argument("--no-encoder-training", action="store_true", help="Keep the serving encoder.")
    p.add_argument(
        "--encoder-negatives",
        action="append",
        default=None,
        choices=("hybrid", "dense"),
        help="Hard negatives of the trained encoders: the serving hybrid run or the base "
        "model's dense ranks; repeatable, one encoder per source (default: hybrid).",
    )
    p.add_argument(
        "--serving-encoder",
        type=Path,
        default=None,
        help="Checkpoint serving today (default: the packaged all-MiniLM-L6-v2).",
    )
    p.add_argument("--encoder-epochs", type=float, default=2.0, help="(2)")
    p.add_argument("--encoder-batch-size", type=positive_int, default=16, help="(16)")
    p.add_argument(
        "--reranker",
        action="append",
        default=None,
        choices=("hybrid", "dense"),
        help="CELI reranker to train: negatives from the best first stage (hybrid) or "
        "today's dense recipe; repeatable (default: hybrid).",
    )
    p.add_argument("--no-reranker", action="store_true", help="Train no reranker.")
    p.add_argument("--rerank-steps", type=positive_int, default=1400, help="(1400)")
    p.add_argument("--rerank-max-len", type=positive_int, default=192, help="(192)")
    p.add_argument("--rerank-backbone", type=Path, default=None, help="(all-MiniLM-L6-v2)")
    p.add_argument(
        "--depth",
        type=positive_int,
        default=100,
        help="First-stage depth, the most reranked (100).",
    )
    p.add_argument(
        "--size",
        default="base",
        help="Deployment size whose SLO bounds the rerank (base, large, xl, xxl; base).",
    )
    p.add_argument(
        "--rerank-budget-ms",
        type=float,
        default=None,
        help="Time a search may spend reranking (default: the size's rerank SLO minus its "
        "search SLO, 200 ms for base).",
    )
    p.add_argument(
        "--depth-table",
        type=Path,
        default=None,
        help="Rerank cost per depth (bench/rerank.py's file; default: the measured CPU table).",
    )
    p.add_argument("--seed", type=int, default=13, help="(13)")
    p.add_argument("--dev-fraction", type=float, default=0.2, help="(0.2)")
    p.add_argument("--val-fraction", type=float, default=0.15, help="(0.15)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads.")
    p.add_argument("--quiet", action="store_true", help="No progress bars.")
    p.add_argument(
        "--rollout",
        action="store_true",
        help="Then roll the best system out as a new generation (`index rollout` with its "
        "encoder, or --retrain, and --retrieval-setting RUN/rollout_setting.json), only when "
        "its paired 95 %% interval against the serving system is above zero; otherwise exit "
        f"{NOT_ROLLED_OUT} with the reason. Without it the report names the command.",
    )
    p.add_argument(
        "--run-dir",
        default=None,
        metavar="DIR",
        help="--rollout: the local stack's run directory (as `index rollout --run-dir`).",
    )


def _run(args: argparse.Namespace) -> int:
    from services.tune.config import TuneConfig
    from services.tune.pipeline import run
    from services.tune.table import table

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = TuneConfig(
        data_dir=args.data,
        out=args.out,
        encoders=() if args.no_encoder_training else tuple(args.encoder or ("ade-spl",)),
        encoder_negatives=tuple(args.encoder_negatives or ("hybrid",)),
        serving_encoder=args.serving_encoder,
        encoder_epochs=args.encoder_epochs,
        encoder_batch_size=args.encoder_batch_size,
        rerankers=() if args.no_reranker else tuple(args.reranker or ("hybrid",)),
        rerank_steps=args.rerank_steps,
        rerank_max_len=args.rerank_max_len,
        rerank_backbone=args.rerank_backbone,
        depth=args.depth,
        size=args.size,
        rerank_budget_ms=args.rerank_budget_ms,
        depth_table=args.depth_table,
        seed=args.seed,
        dev_fraction=args.dev_fraction,
        val_fraction=args.val_fraction,
        threads=args.threads,
        progress=not args.quiet,
    )
    report = run(cfg, command=shlex.join(["gtr-retrieval", *args.argv]))
    print(table(report))
    plan = report["rollout"]
    location = [] if args.run_dir is None else ["--run-dir", args.run_dir]
    best = json.dumps(report["best"] | {"report": str(Path(args.out) / "report.json")})
    if not args.rollout:
        print(f"rollout ({plan['reason']}): gtr-retrieval {shlex.join(plan['argv'] + location)}")
        print(best)  # the last line: JSON
        return 0
    print(best)
    if not plan["warranted"]:
        print(f"not rolled out: {plan['reason']}", file=sys.stderr)
        return NOT_ROLLED_OUT
    if plan["reranker"]:
        print(f"note: {plan['reranker']}", file=sys.stderr)
    return _index_rollout([*plan["argv"], *location, *(["--quiet"] if args.quiet else [])])


def _index_rollout(argv: list[str]) -> int:
    """``gtr-retrieval index rollout ...`` in this process (the index group's own parser;
    not :mod:`services.cli.main`, which imports this module)."""
    from services.cli import generation_commands, index_commands

    parser = argparse.ArgumentParser(prog="gtr-retrieval")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    index_commands.add_cli(sub)
    generation_commands.add_cli(sub)
    args = parser.parse_args(argv)
    args.settings, args.argv = [], argv
    return int(args.func(args))
