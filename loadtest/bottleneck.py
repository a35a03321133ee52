"""End to end against its bottleneck: gateway Search throughput ÷ Triton encode-only
throughput, the same queries at the same concurrency, measured in one run.

    python -m loadtest.bottleneck --stack-json /tmp/c-run/stack.json [--concurrency 16]
    python -m loadtest.bottleneck --target HOST:PORT --triton HOST:PORT

On a CPU the query encoder is the expensive stage of a search (the index and Redis cost
a fraction of it), so a gateway that adds little should get close to what Triton alone
embeds: the goal is ``ratio`` ≥ 0.8. Both sides are closed loops of ``--concurrency``
callers (Search with k=``--k`` through the gateway; one-query ``embed`` calls straight to
Triton with ``services.encoder.triton_client``), run in ``--rounds`` alternating slices so
drift on a shared machine hits both, and the medians compared. Prints a line per round,
then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

from loadtest.closedloop import ClosedLoopResult, closed_loop
from loadtest.target import (
    DEFAULT_ADDRESS,
    Target,
    add_target_arguments,
    target_from_args,
    target_from_stack,
)
from loadtest.workload import load_queries
from retrieval.v1 import search_pb2, search_pb2_grpc


async def measure(
    target: Target, triton_url: str, queries: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    from services.encoder.triton_client import TritonEncoder, TritonEncoderConfig

    requests = [search_pb2.SearchRequest(query=q, k=args.k) for q in queries]
    encoder = await TritonEncoder.connect(TritonEncoderConfig(triton_url))
    channel = target.aio_channel()
    try:
        stub = search_pb2_grpc.SearchServiceStub(channel)
        metadata = target.metadata or None

        def search(i: int) -> Any:
            return stub.Search(requests[i % len(requests)], timeout=args.timeout, metadata=metadata)

        def encode(i: int) -> Any:
            return encoder.encode([queries[i % len(queries)]], "query", timeout=args.timeout)

        for call in (search, encode):  # warm-up: connections, Triton's first batches
            await closed_loop(call, args.concurrency, min(2.0, args.seconds))
        gw: list[ClosedLoopResult] = []
        tr: list[ClosedLoopResult] = []
        for r in range(args.rounds):
            gw.append(await closed_loop(search, args.concurrency, args.seconds))
            tr.append(await closed_loop(encode, args.concurrency, args.seconds))
            print(
                f"round {r + 1}: gateway {gw[-1].throughput:7.1f} searches/s "
                f"(p50 {gw[-1].percentile_ms(50):.1f} ms, errors "
                f"{gw[-1].errors or '-'}), triton "
                f"{tr[-1].throughput:7.1f} encodes/s (p50 {tr[-1].percentile_ms(50):.1f} ms)",
                flush=True,
            )
    finally:
        await channel.close()
        await encoder.close()
    gateway_rate = statistics.median(r.throughput for r in gw)
    triton_rate = statistics.median(r.throughput for r in tr)
    ratios = [g.throughput / t.throughput for g, t in zip(gw, tr, strict=True) if t.throughput]
    return {
        "concurrency": args.concurrency,
        "gateway_searches_per_s": gateway_rate,
        "triton_encodes_per_s": triton_rate,
        "ratio": gateway_rate / triton_rate if triton_rate else None,
        "rounds_ratio_min": min(ratios, default=None),
        "rounds_ratio_max": max(ratios, default=None),
        "gateway_p50_ms": statistics.median(r.percentile_ms(50) for r in gw),
        "triton_p50_ms": statistics.median(r.percentile_ms(50) for r in tr),
        "gateway_errors": sum((sum(r.codes.values()) - r.codes["OK"] for r in gw), 0),
        "goal": 0.8,
    }


def endpoints(args: argparse.Namespace) -> tuple[Target, str]:
    target = target_from_args(args)
    triton = args.triton
    if args.stack_json is not None:
        stack = json.loads(Path(args.stack_json).read_text(encoding="utf-8"))
        if args.address == DEFAULT_ADDRESS:  # no --target given: the stack's gateway
            target = target_from_stack(stack, token=target.token)
        triton = triton or stack["triton_grpc"]
    if not triton:
        raise SystemExit("error: --triton HOST:PORT or --stack-json is needed")
    return target, triton


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bottleneck", description=(__doc__ or "").split("\n\n")[0]
    )
    add_target_arguments(p)
    p.add_argument("--triton", default=None, help="Triton gRPC host:port")
    p.add_argument(
        "--stack-json",
        type=Path,
        default=None,
        help="stack.json of `gtr-retrieval up` (gateway and Triton addresses)",
    )
    p.add_argument("--concurrency", type=int, default=16, help="callers on each side (16)")
    p.add_argument("--seconds", type=float, default=5.0, help="per round and side (5)")
    p.add_argument("--rounds", type=int, default=3, help="alternations (3)")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--timeout", type=float, default=10.0, help="deadline per call (10 s)")
    p.add_argument("--queries", type=Path, default=None, help="BEIR queries.jsonl")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    target, triton = endpoints(args)
    out = asyncio.run(measure(target, triton, load_queries(args.queries), args))
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))
    return out


if __name__ == "__main__":
    main()
