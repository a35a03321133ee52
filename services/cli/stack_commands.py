"""``gtr-retrieval up``: the local stack."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.cli.common import config_from_args, run_handler

if TYPE_CHECKING:
    from services.stack.config import StackConfig


def add_cli(sub: Any) -> None:
    up = sub.add_parser(
        "up",
        help="Start the whole system locally, ingest a corpus, print example searches, serve.",
        description="Starts redis-server, Triton (CPU model repository of the default "
        "model), the index shards, the rerank service and the gateway as child "
        "processes; trains the IVF-PQ index on the corpus on the first run (fewer PQ "
        "bits under 256 documents; at least 2 documents, docs/index.md); ingests the "
        "corpus (default: the Python standard library documentation); prints a few "
        "example searches that fit the corpus (for --corpus, the first queries of a "
        "queries.jsonl beside it, as in a BEIR folder; none without one); then serves "
        "until Ctrl-C. A child that exits is restarted "
        "(same port, same data; with backoff; logged and counted in "
        "<run-dir>/stack.json); one that fails more than --max-restarts times within "
        "--restart-window seconds stops the whole stack. It records the index's first "
        "generation (g1) and runs the shards of every index generation in a running state "
        "whose index is trained (a rollout's target beside the serving one), publishing "
        "their addresses in Redis ({gtr}:addrs) and <run-dir>/stack.json, and stops those of "
        "retired or failed generations (docs/generations.md); `index rollout --run-dir` "
        "finds Redis, Triton, its model repository and <run-dir>/generations/ (where new "
        "indexes go) in stack.json. State lives in --run-dir, so a "
        "second run resumes, a rollout's target's shards included. Logs: <run-dir>/logs/.",
    )
    up.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="JSONL corpus (default: stdlib); example searches come from a queries.jsonl "
        "beside it.",
    )
    up.add_argument("--run-dir", type=Path, default=Path(".run"), help="State and logs.")
    up.add_argument("--shards", type=int, default=2, help="Index shards (fixed per run dir).")
    up.add_argument("--replicas", type=int, default=1, help="Replicas per shard.")
    up.add_argument(
        "--encoder",
        choices=["triton", "inprocess"],
        default="triton",
        help="Embed through Triton (default) or inside the gateway process.",
    )
    up.add_argument(
        "--query-precision",
        choices=["auto", "int8", "fp32"],
        default="auto",
        help="Triton's query tower. auto (default): int8 when its gates pass, else fp32 "
        "(saying why); a run dir whose first `up` exported fp32 stays fp32. int8: the "
        "default model's export with query.int8.onnx (`encoder export --query-precision "
        "int8`): about 2x faster query encodes on CPU, documents stay FP32; gated at "
        "export (parity vs the FP32 graph here; dev nDCG@10 on SciFact, the result "
        "committed for the default model's graphs when no data is here), refused if a gate "
        "fails; figures in <run-dir>/export-int8/query_int8.json. fp32: the FP32 graph for "
        "both kinds. Pick it at a run dir's first `up`: it decides the encoder's digest that "
        "generation g1 records. --encoder inprocess (PyTorch) is fp32 only.",
    )
    up.add_argument(
        "--document-precision",
        choices=["auto", "int8", "fp32"],
        default=None,
        help="Triton's document tower. Unasked: the run dir's (the documents its first `up` "
        "stored), else fp32, the FP32 graph. int8: documents "
        "through the int8 query graph too (`encoder export --document-precision int8`), one "
        "per run: a third to half the CPU per document encode (every upsert, and a "
        "rollout's re-embedding); gated like the query tower (dev nDCG@10 of int8 queries "
        "over int8 documents within 0.003 of FP32), refused if a gate fails; figures in "
        "<run-dir>/export-int8-docs/query_int8.json; needs int8 queries. Not the default: "
        "through the stack it cost hybrid RRF 0.012 dev nDCG@10 on SciFact (the default "
        "weighted fusion and dense were within 0.002). auto: int8 when its gates pass, else "
        "fp32 (saying why).",
    )
    up.add_argument(
        "--query-encoder",
        choices=["gateway", "triton"],
        default="gateway",
        help="Who runs a query's graph with --encoder triton. gateway (default): the "
        "gateway, from the model repository's folder of the version Triton serves (the "
        "same graph and tokenizer, checked against Triton's vectors at start; one hop "
        "fewer per search, docs/performance.md); documents still go to Triton. triton: "
        "Triton embeds queries too.",
    )
    up.add_argument(
        "--triton-nice",
        type=int,
        choices=range(20),
        metavar="0-19",
        default=10,
        help="Triton's scheduling weight, as its session's nice, while it encodes only "
        "documents (--query-encoder gateway): at 10 (default) a search's work runs before "
        "a write's or a rollout's document encode when both want a CPU; searches' p99 with "
        "one of two CPUs busy fell by a fifth, writes waited longer "
        '(docs/performance.md, "Searches before document encodes"). 0: the same weight '
        "as the other processes. Needs the kernel's autogroup (most distributions).",
    )
    up.add_argument("--no-rerank", action="store_true", help="Do not start the reranker.")
    up.add_argument(
        "--no-prometheus", action="store_true", help="Do not start Prometheus (if installed)."
    )
    up.add_argument("--rerank-checkpoint", type=Path, default=None, help="CELI checkpoint dir.")
    up.add_argument(
        "--rerank-checkpoint-dir",
        type=Path,
        default=None,
        help="A folder of CELI checkpoints the reranker also serves by name (a generation's "
        "retrieval setting names one: `gtr-retrieval tune` leaves them in RUN/rerankers).",
    )
    up.add_argument("--port", type=int, default=50051, help="Gateway port (0 = free port).")
    up.add_argument(
        "--http-port",
        type=int,
        default=8080,
        help="The gateway's HTTP/JSON port (the same API as JSON over HTTP, curl examples in "
        "README.md, docs/http.md; TLS and tokens as the gRPC port under --tls / --auth); "
        "0 = a free port, -1 = none (default 8080).",
    )
    up.add_argument(
        "--no-serve", action="store_true", help="Exit after the example searches (for scripts)."
    )
    up.add_argument(
        "--redis-fsync",
        choices=["always", "everysec"],
        default="always",
        help="Redis AOF fsync policy. always (default): an acknowledged upsert is on disk "
        "(survives a crash of the machine); everysec: faster writes, the last second "
        "of them can be lost on a power loss or kernel crash (see docs/performance.md).",
    )
    up.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="A child that fails more often than this within --restart-window is not "
        "restarted again: the whole stack stops (default 5; 0 = never restart).",
    )
    up.add_argument(
        "--restart-window",
        type=float,
        default=120.0,
        help="Seconds over which --max-restarts counts a child's failures (default 120).",
    )
    up.add_argument(
        "--auth",
        action="store_true",
        help="Require bearer tokens at the gateway: a read and a write token are generated "
        "into <run-dir>/auth/ (read.tokens, write.tokens; their paths printed at start). "
        "The client commands find them through <run-dir>/stack.json (their --run-dir). "
        "The local Redis requires a "
        "password too (<run-dir>/auth/redis.password; the children read the Redis URL from "
        "<run-dir>/redis.url, mode 0600). Default: the gateway and Redis run open, on "
        "loopback only, and say so.",
    )
    up.add_argument(
        "--tls",
        action="store_true",
        help="Make a throwaway CA and certificates in <run-dir>/tls/ (scripts/make_certs.py) "
        "and use them on every hop: the gateway serves TLS; the shards, the reranker, "
        "Triton's gRPC and Redis (TLS only, rediss://) require the gateway's client "
        "certificate (mTLS). Triton's HTTP endpoint (no TLS, no tokens) is closed either way.",
    )
    up.add_argument(
        "--query-cache",
        action="store_true",
        help="Turn on the gateway's query-embedding cache (in the stack's Redis): a "
        "repeated query skips the encoder and its response says embedding_cached. "
        "Default: off.",
    )
    up.add_argument(
        "--query-cache-ttl-s",
        type=float,
        default=None,
        help="With --query-cache: lifetime of a cached query embedding (default: the "
        "gateway's, 3600).",
    )
    up.add_argument(
        "--query-cache-max-entries",
        type=int,
        default=None,
        help="With --query-cache: most cached query embeddings, least recently used "
        "evicted past it (default: the gateway's, 50000).",
    )
    up.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="Admission limit of the gateway and of each shard replica: requests in flight "
        "at most (a search counts one per 25 hits), one more is refused at once with "
        "RESOURCE_EXHAUSTED and a retry-after-ms hint. Default: 16 per CPU this process "
        "may use (32 on 2 cores; docs/performance.md 'Sizing --max-in-flight'); 0 = no limit.",
    )
    up.add_argument(
        "--otlp-endpoint",
        default=None,
        help="OpenTelemetry: every child of ours (gateway, shards, reranker) sends its trace "
        "spans over OTLP/gRPC to this collector (http://host:4317); a search is one trace "
        "across them (docs/tracing.md). Default: tracing off.",
    )
    up.add_argument(
        "--trace-sample-ratio",
        type=float,
        default=1.0,
        help="With --otlp-endpoint: share of the searches and writes traced (0..1, default "
        "1); a request whose traceparent says sampled is traced whatever this says.",
    )
    up.add_argument(
        "--triton-otlp-endpoint",
        default=None,
        help="OpenTelemetry: Triton's spans go over OTLP/HTTP to this URL "
        "(http://host:4318/v1/traces; Triton's build exports over HTTP only), and join the "
        "gateway's trace. Triton samples 1 in round(1/--trace-sample-ratio) inferences by "
        "its own count (docs/tracing.md). Default: Triton not traced.",
    )
    up.add_argument(
        "--no-fork-shards",
        action="store_true",
        help="Start every shard process as a fresh interpreter. Default: shard processes "
        "are forked from one that imported their libraries once (~0.5 s of CPU less per "
        "start: a rollout's target shards, a restarted replica; docs/generations.md "
        "'Shard processes forked, not exec'd').",
    )
    up.add_argument("--fresh", action="store_true", help="Delete --run-dir first.")
    up.add_argument("--log-level", default=os.environ.get("GTR_LOG_LEVEL", "WARNING"))
    # its children stopped, `up` ends without the interpreter's teardown of torch, ONNX
    # Runtime and faiss (2.5 s of a core after the last child, profiled with py-spy)
    up.set_defaults(handler=_up, exit_at_once=True)


def stack_config(args: argparse.Namespace) -> StackConfig:
    """``up``'s flags as the stack's config (refusing combinations that make no sense)."""
    from services.stack.children import RestartPolicy
    from services.stack.config import StackConfig, default_max_in_flight

    if not args.query_cache and (
        args.query_cache_ttl_s is not None or args.query_cache_max_entries is not None
    ):
        raise SystemExit(
            "error: --query-cache-ttl-s and --query-cache-max-entries shape the query cache; "
            "add --query-cache to turn it on"
        )
    for flag in ("shards", "replicas"):  # checked before anything starts or is encoded
        if getattr(args, flag) < 1:
            raise SystemExit(f"error: --{flag} must be at least 1")
    if args.corpus is not None and not args.corpus.is_file():
        raise SystemExit(f"error: --corpus {args.corpus}: no such file")
    if args.max_in_flight is not None and args.max_in_flight < 0:
        raise SystemExit("error: --max-in-flight is a count of requests (0 = no limit)")
    if not 0.0 <= args.trace_sample_ratio <= 1.0:
        raise SystemExit("error: --trace-sample-ratio is a share of requests, 0..1")
    for flag in ("query_precision", "document_precision"):
        if getattr(args, flag) == "int8" and args.encoder != "triton":
            raise SystemExit(
                f"error: --{flag.replace('_', '-')} int8 is the Triton encoder's ONNX int8 "
                "graph; --encoder inprocess runs the PyTorch model (fp32 only)"
            )
    if args.document_precision == "int8" and args.query_precision == "fp32":
        raise SystemExit(
            "error: --document-precision int8 comes with int8 queries (their quality is "
            "measured as a pair); drop --query-precision fp32"
        )
    return config_from_args(
        StackConfig,
        args,
        rerank=not args.no_rerank,
        prometheus=not args.no_prometheus,
        gateway_port=args.port,
        http_port=None if args.http_port < 0 else args.http_port,
        serve=not args.no_serve,
        restart=RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window),
        max_in_flight=(
            default_max_in_flight() if args.max_in_flight is None else args.max_in_flight
        ),
        fork_shards=not args.no_fork_shards,
    )


def _up(args: argparse.Namespace) -> int:
    """``up``; a user's mistake found on the way (a domain error, e.g. a corpus too small
    to train on) is one ``error:`` line and exit 2, once every child has stopped."""
    import shutil

    from services.process.logs import configure_logging
    from services.stack.launcher import run_stack

    config = stack_config(args)
    configure_logging("text", args.log_level.upper(), service="up")
    if args.fresh and args.run_dir.exists():
        shutil.rmtree(args.run_dir)
    return run_handler(lambda _: run_stack(config), args)
