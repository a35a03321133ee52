"""``gtr-retrieval index train|serve|stats|snapshot``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from services.cli.common import add_command, add_group, client_tls, tls_flags
from services.cli.serve import add_serve


def add_cli(sub: Any) -> None:
    isub = add_group(sub, "index", help="FAISS IVF-PQ shards: train, serve, inspect.")

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
    train.add_argument(
        "--pq-bits",
        type=int,
        default=None,
        help="Bits per PQ code (default 8; fewer when the sample has under 256 vectors).",
    )
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

    stats = add_command(
        isub,
        "stats",
        _stats,
        help="Print replicas' Stats (sizes, positions, quantizer drift) as JSON.",
        description="One address: that replica's Stats as a JSON object. Several (or a "
        "gateway --shards list, 'a:1,a:2;b:1'): a JSON list with one entry per replica, "
        '{"address", "stats"} for each that answered and {"address", "error": {"code", '
        '"message"}} for each that did not. A replica that does not answer is also one '
        "line on stderr (error: UNAVAILABLE: shard replica ADDRESS: ...), and the exit "
        "status is then 1, as for any gRPC error of the client commands.",
    )
    stats.add_argument(
        "address", nargs="+", help="host:port of a shard replica (several: each one's Stats)."
    )
    snapshot = add_command(
        isub,
        "snapshot",
        _snapshot,
        help="Ask a replica to write a snapshot now, covering every change written "
        "before (it applies the log up to its end first).",
        description="Exit status 1, with the gRPC status on stderr, when the replica "
        "does not answer or refuses.",
    )
    snapshot.add_argument("address", help="host:port of the shard replica.")
    for cmd in (stats, snapshot):
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


def _shard_tls(args: argparse.Namespace) -> Any:
    return client_tls(*tls_flags(args, "tls"), "the replica's TLS")


def _rpc_failure(address: str, exc: Any) -> dict[str, str]:
    """What a failed call to ``address`` said: its gRPC status name and message."""
    code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return {"code": code, "message": f"shard replica {address}: {details}"}


def _addresses(given: list[str]) -> list[str]:
    """The replicas named, one by one: the gateway's --shards syntax ('a:1,a:2;b:1') is
    taken too, so a generation's addresses can be pasted as they are."""
    return [a.strip() for spec in given for a in spec.replace(";", ",").split(",") if a.strip()]


def _stats(args: argparse.Namespace) -> int:
    """Every replica's Stats, asked at once; the ones that answered are printed even
    when others did not (each of those marked, and named on stderr: exit status 1)."""
    import grpc
    from google.protobuf.json_format import MessageToDict, MessageToJson

    from retrieval.v1 import index_pb2, index_pb2_grpc
    from services.rpc.tls import channel

    tls = _shard_tls(args)
    addresses = _addresses(args.address)
    channels = [channel(a, tls) for a in addresses]
    try:
        calls = [
            index_pb2_grpc.IndexShardServiceStub(c).Stats.future(
                index_pb2.ShardStatsRequest(), timeout=10
            )
            for c in channels
        ]
        replies: list[Any] = []
        for address, call in zip(addresses, calls, strict=True):
            try:
                replies.append(call.result())
            except grpc.RpcError as exc:
                replies.append(_rpc_failure(address, exc))
    finally:
        for c in channels:
            c.close()
    failed = [r for r in replies if isinstance(r, dict)]
    for failure in failed:
        print(f"error: {failure['code']}: {failure['message']}", file=sys.stderr)
    if len(addresses) == 1:
        if not failed:
            print(MessageToJson(replies[0]))
    else:
        rows = [
            {"address": a, "error": r}
            if isinstance(r, dict)
            else {"address": a, "stats": MessageToDict(r)}
            for a, r in zip(addresses, replies, strict=True)
        ]
        print(json.dumps(rows, indent=2))
    return 1 if failed else 0


def _snapshot(args: argparse.Namespace) -> int:
    import grpc

    from retrieval.v1 import index_pb2, index_pb2_grpc
    from services.rpc.tls import channel

    with channel(args.address, _shard_tls(args)) as shard:
        try:
            reply = index_pb2_grpc.IndexShardServiceStub(shard).Snapshot(
                index_pb2.SnapshotRequest(), timeout=120
            )
        except grpc.RpcError as exc:
            failure = _rpc_failure(args.address, exc)
            print(f"error: {failure['code']}: {failure['message']}", file=sys.stderr)
            return 1
    print(f"snapshot at {reply.position}: {reply.path}")
    return 0
