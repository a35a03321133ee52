"""Load test of a running gateway: searches (and optional upserts) at a fixed concurrency.

    python loadtest/search_load.py --gateway 127.0.0.1:50051 --concurrency 16 --seconds 30 \
        --queries ../shared/data/scifact/queries.jsonl --upserts-per-s 50

Traffic goes only to the address given (loopback by default); the run is bounded by
--seconds and --max-requests and stops by itself. It prints a table and, last, one JSON
line: qps, p50/p95/p99 latency, error counts by status code, the fraction of partial
results, and the search SLO of the encoder profile next to the measured p99
(``p99_over_slo``: below 1.0 meets it). The baseline in the same run is a single-client
pass (``qps_concurrency_1``): ``scaling = qps / qps_concurrency_1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter
from pathlib import Path

import grpc

from retrieval.v1 import documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc

SLO_MS = {"base": 17.0, "large": 34.0, "xl": 96.0, "xxl": 349.0}
FALLBACK_QUERIES = [
    "read a csv file",
    "parse command line arguments",
    "compute a sha256 hash",
    "sort a list in place",
    "open a url and read the response",
    "format a date as a string",
]


def load_queries(path: str | None) -> list[str]:
    if path and Path(path).exists():
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line)["text"] for line in fh if line.strip()]
    return FALLBACK_QUERIES


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_phase(
    address: str,
    queries: list[str],
    concurrency: int,
    seconds: float,
    max_requests: int,
    k: int,
    timeout: float,
) -> dict[str, object]:
    latencies: list[float] = []
    codes: Counter[str] = Counter()
    partial = 0
    sent = 0
    stop_at = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(address) as channel:
        stub = search_pb2_grpc.SearchServiceStub(channel)

        async def worker(seed: int) -> None:
            nonlocal sent, partial
            rng = random.Random(seed)
            while time.monotonic() < stop_at and sent < max_requests:
                sent += 1
                request = search_pb2.SearchRequest(query=rng.choice(queries), k=k)
                start = time.perf_counter()
                try:
                    reply = await stub.Search(request, timeout=timeout)
                    latencies.append((time.perf_counter() - start) * 1000.0)
                    codes["OK"] += 1
                    partial += int(reply.partial)
                except grpc.aio.AioRpcError as exc:
                    codes[exc.code().name] += 1

        began = time.perf_counter()
        await asyncio.gather(*[worker(i) for i in range(concurrency)])
        elapsed = time.perf_counter() - began
    ok = codes.get("OK", 0)
    return {
        "qps": ok / elapsed if elapsed else 0.0,
        "p50_ms": percentile(latencies, 0.50),
        "p95_ms": percentile(latencies, 0.95),
        "p99_ms": percentile(latencies, 0.99),
        "mean_ms": statistics.fmean(latencies) if latencies else float("nan"),
        "codes": dict(codes),
        "partial_fraction": partial / ok if ok else 0.0,
        "requests": sum(codes.values()),
    }


async def upsert_stream(address: str, per_second: float, seconds: float) -> int:
    if per_second <= 0:
        return 0
    done = 0
    stop_at = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(address) as channel:
        stub = documents_pb2_grpc.DocumentServiceStub(channel)
        while time.monotonic() < stop_at:
            doc = documents_pb2.Document(
                id=f"loadtest-{done}", title="load test", text=f"synthetic document number {done}"
            )
            try:
                await stub.Upsert(documents_pb2.UpsertRequest(documents=[doc]), timeout=5.0)
                done += 1
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(1.0 / per_second)
    return done


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    queries = load_queries(args.queries)
    baseline = await run_phase(
        args.gateway, queries, 1, min(5.0, args.seconds), args.max_requests, args.k, args.timeout
    )
    loaded, upserts = await asyncio.gather(
        run_phase(
            args.gateway,
            queries,
            args.concurrency,
            args.seconds,
            args.max_requests,
            args.k,
            args.timeout,
        ),
        upsert_stream(args.gateway, args.upserts_per_s, args.seconds),
    )
    slo = SLO_MS[args.size]
    p99 = float(loaded["p99_ms"])  # type: ignore[arg-type]
    return {
        "concurrency": args.concurrency,
        "qps": loaded["qps"],
        "qps_concurrency_1": baseline["qps"],
        "scaling": float(loaded["qps"]) / float(baseline["qps"] or 1.0),  # type: ignore[arg-type]
        "p50_ms": loaded["p50_ms"],
        "p95_ms": loaded["p95_ms"],
        "p99_ms": p99,
        "p50_ms_concurrency_1": baseline["p50_ms"],
        "codes": loaded["codes"],
        "partial_fraction": loaded["partial_fraction"],
        "upserts": upserts,
        "size": args.size,
        "slo_ms": slo,
        "p99_over_slo": p99 / slo,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", default="127.0.0.1:50051")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-requests", type=int, default=200_000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--queries", default=None, help="BEIR queries.jsonl (default: built-in)")
    parser.add_argument("--upserts-per-s", type=float, default=0.0)
    parser.add_argument("--size", choices=sorted(SLO_MS), default="base")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    for key, value in report.items():
        print(f"{key:>22}: {value}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
