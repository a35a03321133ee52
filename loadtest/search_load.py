"""Closed-loop capacity test of a running gateway: Search at a fixed concurrency.

    python -m loadtest.search_load --gateway 127.0.0.1:50051 --concurrency 16 --seconds 30 \
        --queries ../shared/data/scifact/queries.jsonl --upserts-per-s 50

What it is for: how many searches per second ``--concurrency`` callers get through (each
sends its next search when the last came back), against a single caller measured in the
same run (``scaling = qps / qps_concurrency_1``). What it is not for: latency under a
given load. A closed loop stops sending while the gateway stalls, so its percentiles
leave out the requests that would have arrived meanwhile (coordinated omission); quote
latency from ``python -m loadtest.openloop`` instead. Optional upserts run beside it on
an open-loop schedule (``--upserts-per-s``, documents from ``--corpus`` under the
``loadtest:`` id prefix). Traffic goes only to ``--gateway`` (loopback by default); the run
is bounded by ``--seconds`` and ``--max-requests``. Prints a table and, last, one JSON line:
qps, p50/p95/p99, errors by status code, the fraction of partial results, and the p99
against the end-to-end Search budget of ``--size`` (``p99_over_slo`` below 1.0 meets it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from loadtest.budget import SIZES, default_slo_ms
from loadtest.closedloop import ClosedLoopResult, closed_loop
from loadtest.results import summarize
from loadtest.runner import RunConfig, run_open_loop
from loadtest.target import Target, add_target_arguments, target_from_args
from loadtest.workload import Workload, load_documents, load_queries
from retrieval.v1 import search_pb2, search_pb2_grpc


async def searches(
    target: Target, queries: list[str], concurrency: int, args: argparse.Namespace
) -> tuple[ClosedLoopResult, int]:
    """(the closed loop's result, how many answers were partial)."""
    partial = 0
    async with target.aio_channel() as channel:
        stub = search_pb2_grpc.SearchServiceStub(channel)

        async def one(i: int) -> None:
            nonlocal partial
            request = search_pb2.SearchRequest(query=queries[i % len(queries)], k=args.k)
            reply = await stub.Search(
                request, timeout=args.timeout, metadata=target.metadata or None
            )
            partial += int(reply.partial)

        seconds = args.seconds if concurrency > 1 else min(5.0, args.seconds)
        result = await closed_loop(one, concurrency, seconds, args.max_requests)
    return result, partial


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    target = target_from_args(args)
    queries = load_queries(args.queries)
    baseline, _ = await searches(target, queries, 1, args)
    tasks: list[Any] = [searches(target, queries, args.concurrency, args)]
    if args.upserts_per_s > 0:
        docs = Workload(
            queries=[], mix={"upsert": 1.0}, documents=load_documents(args.corpus, limit=2000)
        )
        run = RunConfig(rate=args.upserts_per_s, duration_s=args.seconds, process="fixed")
        tasks.append(run_open_loop(target, docs, run))
    outcomes = await asyncio.gather(*tasks)
    loaded, partial = outcomes[0]
    upserts = summarize(outcomes[1], slo_ms=1000.0) if len(outcomes) > 1 else None
    slo = default_slo_ms(args.size)
    p99 = loaded.percentile_ms(99)
    ok = loaded.codes["OK"]
    return {
        "concurrency": args.concurrency,
        "qps": loaded.throughput,
        "qps_concurrency_1": baseline.throughput,
        "scaling": loaded.throughput / baseline.throughput if baseline.throughput else None,
        "p50_ms": loaded.percentile_ms(50),
        "p95_ms": loaded.percentile_ms(95),
        "p99_ms": p99,
        "p50_ms_concurrency_1": baseline.percentile_ms(50),
        "codes": dict(loaded.codes),
        "partial_fraction": partial / ok if ok else 0.0,
        "upserts": upserts["ok"] if upserts else 0,
        "upsert_errors": upserts["errors"] if upserts else {},
        "size": args.size,
        "slo_ms": slo,
        "p99_over_slo": p99 / slo,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.search_load", description=(__doc__ or "").split("\n\n")[0]
    )
    add_target_arguments(parser, address_flag="--gateway")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-requests", type=int, default=200_000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--queries", type=Path, default=None, help="BEIR queries.jsonl")
    parser.add_argument("--corpus", type=Path, default=None, help="BEIR corpus.jsonl (upserts)")
    parser.add_argument("--upserts-per-s", type=float, default=0.0)
    parser.add_argument("--size", choices=sorted(SIZES), default="minilm")
    args = parser.parse_args(argv)
    report = asyncio.run(main_async(args))
    for key, value in report.items():
        print(f"{key:>22}: {value}")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
