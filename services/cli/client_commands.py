"""``gtr-retrieval ingest | search | get | delete``: a client of a running gateway.

The client itself is the SDK (``gtr_client``: channel, token, TLS, retries, the calls),
reached through :mod:`services.client.gateway`; this module is the commands' flags and
output."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from gtr_client import ApiError
from services.cli.common import uint32
from services.client.gateway import format_hits, ingest_file, resolve_gateway, search_once


def _add_gateway_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway",
        default=None,
        help="Gateway address host:port (default: $GTR_GATEWAY_ADDRESS, else the local "
        "stack started by 'gtr-retrieval up' (see --run-dir), else 127.0.0.1:50051).",
    )
    parser.add_argument(
        "--run-dir",
        dest="stack_run_dir",
        default=None,
        help="Run directory of the local stack ('up --run-dir'): its stack.json names the "
        "gateway, and under 'up --auth' / '--tls' its token and CA (default: $GTR_RUN_DIR, "
        "else .run).",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="Deadline per call (s).")
    parser.add_argument(
        "--token",
        default=None,
        help="Bearer token sent as 'authorization: Bearer <token>' (default: $GTR_TOKEN; "
        "for a local stack started with 'up --auth', its write token). Searches and gets "
        "need a read or write token, ingest, upsert and delete a write token.",
    )
    parser.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA to trust: talk TLS to the gateway (default: $GTR_TLS_CA; the local "
        "stack's with 'up --tls').",
    )
    parser.add_argument(
        "--tls-client-cert",
        default=None,
        help="PEM client certificate for a gateway that requires one (mTLS; default "
        "$GTR_TLS_CLIENT_CERT); with --tls-client-key.",
    )
    parser.add_argument(
        "--tls-client-key",
        default=None,
        help="PEM key of --tls-client-cert (default: $GTR_TLS_CLIENT_KEY).",
    )


def add_cli(sub: Any) -> None:
    ingest = sub.add_parser(
        "ingest",
        help="Upsert a corpus file through the gateway.",
        description="Upsert every document of FILE (BEIR corpus.jsonl or JSONL with "
        "id/_id, title, text, metadata) in batches, with a progress bar.",
    )
    ingest.add_argument("file", help="Corpus JSONL file.")
    ingest.add_argument("--batch", type=int, default=64, help="Documents per Upsert (1..256).")
    ingest.add_argument("--parallel", type=int, default=2, help="Upserts in flight.")
    ingest.add_argument("--limit", type=int, default=None, help="Stop after N documents.")
    _add_gateway_flag(ingest)
    ingest.set_defaults(handler=_rpc_errors(_ingest), timeout=120.0)

    search = sub.add_parser(
        "search",
        help="Search and print the hits as a table.",
        description="Search through the gateway and print the hits as a table (or --json): "
        "the header says the time per stage, the first stage that answered (dense, sparse "
        "= BM25, or hybrid with its fusion), the model, and a partial answer or a skipped "
        "rerank.",
    )
    search.add_argument("query", help="Query text.")
    search.add_argument("-k", type=uint32, default=5, help="Number of hits (1..1000).")
    search.add_argument("--rerank", action="store_true", help="Rerank with CELI.")
    search.add_argument("--depth", type=uint32, default=0, help="Rerank depth (0 = auto).")
    search.add_argument(
        "--consistency", choices=["eventual", "strong"], default="eventual", help="Freshness."
    )
    search.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="Metadata filter; repeatable (all must match).",
    )
    search.add_argument(
        "--mode",
        choices=["dense", "sparse", "hybrid"],
        default=None,
        help="First stage (default: the gateway's, hybrid unless configured otherwise).",
    )
    search.add_argument(
        "--fusion",
        choices=["rrf", "weighted"],
        default=None,
        help="Fusion of a hybrid search (default: the gateway's). This and the three "
        "flags below are refused with --mode dense or sparse, and by a gateway whose "
        "default mode is one of them when --mode is not given.",
    )
    search.add_argument(
        "--rrf-k", type=uint32, default=None, help="k of --fusion rrf, 1..10000 (default: 60)."
    )
    search.add_argument(
        "--dense-weight",
        type=float,
        default=None,
        help="Weight of the dense list in --fusion weighted, 0..1 (default: 0.5).",
    )
    search.add_argument(
        "--candidates",
        type=uint32,
        default=None,
        help="Hits taken from each list of a hybrid search before fusing: k..1000 "
        "(default: the gateway's, at least k and the rerank depth).",
    )
    search.add_argument(
        "--json",
        action="store_true",
        help="Print the answer as JSON (the SDK's SearchResult: hits with id, score, "
        "title, text, metadata, ranks; partial, timings, mode, fusion, generation, ...).",
    )
    _add_gateway_flag(search)
    search.set_defaults(handler=_rpc_errors(_search))

    get = sub.add_parser("get", help="Print one document.")
    get.add_argument("id")
    _add_gateway_flag(get)
    get.set_defaults(handler=_rpc_errors(_get))

    delete = sub.add_parser("delete", help="Delete documents by id.")
    delete.add_argument("ids", nargs="+")
    _add_gateway_flag(delete)
    delete.set_defaults(handler=_rpc_errors(_delete))


def _rpc_errors(
    handler: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """``handler`` whose failed gateway call is said on stderr as ``error: CODE: details``,
    exit status 1 (the code is what a script branches on: UNAVAILABLE, NOT_FOUND, ...); a
    file it cannot read (``ingest FILE``) is ``error: ...``, exit status 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ApiError as exc:
            print(f"error: {exc.code}: {exc.details}", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return run


def _ingest(args: argparse.Namespace) -> int:
    gateway = resolve_gateway(args)
    n = ingest_file(gateway, args.file, args.batch, args.parallel, args.limit, args.timeout)
    print(f"upserted {n} documents through {gateway.address}")
    return 0


def _search(args: argparse.Namespace) -> int:
    fusion = {  # a hybrid search's options, each named as the request and its flag's dest
        "fusion": args.fusion,
        "rrf_k": args.rrf_k,
        "dense_weight": args.dense_weight,
        "candidates": args.candidates,
    }
    given = [f"--{name.replace('_', '-')}" for name, value in fusion.items() if value is not None]
    if given and args.mode in ("dense", "sparse"):  # the gateway refuses them alike
        print(
            f"error: {', '.join(given)}: only a hybrid search fuses, not --mode {args.mode}",
            file=sys.stderr,
        )
        return 2
    response = search_once(
        resolve_gateway(args),
        args.query,
        args.k,
        args.timeout,
        consistency=args.consistency,
        filters=args.filter,
        rerank=args.rerank,
        depth=args.depth,
        mode=args.mode,
        **fusion,
    )
    if args.json:
        print(json.dumps(response.to_dict(), indent=2, ensure_ascii=False))
    else:
        print(format_hits(args.query, response))
    return 0


def _get(args: argparse.Namespace) -> int:
    with resolve_gateway(args).client(args.timeout) as client:
        d = client.get(args.id)
    print(
        json.dumps(
            {"id": d.id, "title": d.title, "text": d.text, "metadata": dict(d.metadata)},
            indent=2,
            ensure_ascii=False,
        )
    )
    return 0


def _delete(args: argparse.Namespace) -> int:
    with resolve_gateway(args).client(args.timeout) as client:
        resp = client.delete(args.ids)
    print(f"deleted {resp.deleted}; not found: {list(resp.not_found)}")
    return 0
