"""``gtr-retrieval index train|serve|stats|snapshot``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from services.cli.common import add_command, client_tls, tls_flags
from services.cli.serve import add_serve


def add_cli(sub: Any) -> None:
    index = sub.add_parser("index", help="FAISS IVF-PQ shards: train, serve, inspect.")
    isub = index.add_subparsers(dest="index_command", metavar="ACTION", required=True)

    train = isub.add_parser(
        "train",
        help="Train the coarse quantizer and PQ codebooks; write the trained, empty index.",
        description="Reads embeddings (.npy, float32 (n, dim), L2-normalised) or encodes a "
        "corpus with the default model, trains IVF-PQ (+ the SQ8 refine codec) on a sample, "
        "and writes trained.faiss, refine.faiss and manifest.json into --out. Defaults "
        "follow the sample size: nlist ≈ 4·√N, PQ with dim/4 bytes; the default nprobe is "
        "the smallest that reaches --target-recall (10-recall@10 against exact search, "
        "measured on up to 1,000 vectors held out of the sample through the shards' search "
        "path), recorded in the manifest with the recall measured. Training warns (and the "
        "manifest says, ivf_advice) when the corpus is so small that a flat index would be "
        "exact and about as fast.",
    )
    source = train.add_mutually_exclusive_group(required=True)
    source.add_argument("--embeddings", type=Path, help="A .npy of embeddings.")
    source.add_argument("--corpus", type=Path, help="A JSONL corpus to encode (default model).")
    train.add_argument("--out", type=Path, required=True, help="Output directory.")
    train.add_argument("--nlist", type=int, default=None, help="Coarse centroids.")
    train.add_argument("--pq-m", type=int, default=None, help="PQ sub-quantizers (divides dim).")
    train.add_argument("--pq-bits", type=int, default=8, help="Bits per PQ code.")
    train.add_argument("--no-refine", action="store_true", help="No SQ8 re-ranking stage.")
    train.add_argument("--refine-factor", type=int, default=4, help="k·factor candidates.")
    train.add_argument(
        "--target-recall",
        type=_recall,
        default=None,
        help="10-recall@10 the tuned default nprobe must reach, in (0, 1] (default 0.99).",
    )
    train.add_argument(
        "--nprobe",
        type=int,
        default=None,
        help="Default nprobe of searches, instead of tuning it (its recall is still measured).",
    )
    train.add_argument("--sample", type=int, default=100_000, help="Max training vectors.")
    train.add_argument("--model", default=None, help="Model name recorded in the manifest.")
    train.add_argument(
        "--gpu",
        action="store_true",
        help="Shards will search on a GPU: default pq_m is the nearest one GPU IVF-PQ "
        "accepts (768-d: 96 instead of 192), and settings it refuses are an error.",
    )
    train.set_defaults(handler=_train)

    add_serve(
        isub,
        help="Run one shard replica (IndexShardService).",
        description="Settings from GTR_SHARD_* env vars or flags; --help lists them.",
        main="services.index.server.process:main",
    )

    for name, helptext in (
        ("stats", "Print a replica's Stats (sizes, positions, quantizer drift) as JSON."),
        (
            "snapshot",
            "Ask a replica to write a snapshot now, covering every change written "
            "before (it applies the log up to its end first).",
        ),
    ):
        cmd = add_command(isub, name, _stats if name == "stats" else _snapshot, help=helptext)
        cmd.add_argument("address", help="host:port of the shard replica.")
        cmd.add_argument("--tls-ca", default=None, help="PEM CA to trust: talk TLS.")
        cmd.add_argument(
            "--tls-client-cert",
            default=None,
            help="PEM client certificate for a replica that requires one (mTLS).",
        )
        cmd.add_argument("--tls-client-key", default=None, help="PEM key of --tls-client-cert.")


def _recall(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def _train(args: argparse.Namespace) -> int:
    import numpy as np

    from services.index.core.train import TrainOptions, train_index

    if args.embeddings:
        vectors = np.load(args.embeddings)
        model = args.model or "unknown"
    else:
        vectors, model = _encode_corpus(args.corpus, args.sample)
    options = TrainOptions(
        nlist=args.nlist,
        pq_m=args.pq_m,
        pq_bits=args.pq_bits,
        refine=not args.no_refine,
        refine_factor=args.refine_factor,
        nprobe=args.nprobe,
        max_train_points=args.sample,
        model=args.model or model,
        gpu=args.gpu,
        **({} if args.target_recall is None else {"target_recall": args.target_recall}),
    )
    manifest = train_index(vectors, args.out, options)
    print(json.dumps(vars(manifest), indent=2))
    return 0


def _encode_corpus(path: Path, limit: int) -> tuple[Any, str]:
    import numpy as np

    from services.corpus.readers import read_corpus
    from services.encoder.model import TorchEmbedder

    embedder = TorchEmbedder()
    texts = [f"{d.title} {d.text}" if d.title else d.text for d in read_corpus(path, limit)]
    rows = [embedder.embed(texts[i : i + 64], "document")[0] for i in range(0, len(texts), 64)]
    return np.concatenate(rows), embedder.model_name


def _shard_channel(args: argparse.Namespace) -> Any:
    from services.common.tls import channel

    tls = client_tls(*tls_flags(args, "tls"), "the replica's TLS")
    return channel(args.address, tls)


def _stats(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToJson

    from retrieval.v1 import index_pb2, index_pb2_grpc

    with _shard_channel(args) as channel:
        reply = index_pb2_grpc.IndexShardServiceStub(channel).Stats(
            index_pb2.ShardStatsRequest(), timeout=10
        )
    print(MessageToJson(reply))
    return 0


def _snapshot(args: argparse.Namespace) -> int:
    from retrieval.v1 import index_pb2, index_pb2_grpc

    with _shard_channel(args) as channel:
        reply = index_pb2_grpc.IndexShardServiceStub(channel).Snapshot(
            index_pb2.SnapshotRequest(), timeout=120
        )
    print(f"snapshot at {reply.position}: {reply.path}")
    return 0
