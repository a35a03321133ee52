"""What the HTTP/JSON port costs a search over gRPC: the same calls to the same gateway over
both ports, p50 latency as a ratio measured in one run.

    .venv/bin/python -m bench.http_overhead [--rounds 6] [--seconds 4] [--concurrency 1]
        [--docs 5000] [--out bench/results/http_overhead.json]

One real stack (bench/gateway_pair.py's): a redis-server, one index shard process (IVF-PQ
trained on the first ``--docs`` SciFact document embeddings, the documents ingested
through the change log) and one gateway process with the in-process encoder
(all-MiniLM-L6-v2), ``--no-auth``, plaintext, serving gRPC and ``--http-port``.

The client (this process) sends the same SciFact queries over both: gRPC through one
grpc.aio channel, HTTP through aiohttp's client (keep-alive connections, the JSON body
encoded and the answer parsed, as any HTTP client does), ``--concurrency`` calls in
flight (1 by default: the latency of a search without queueing behind another), in
rounds that alternate gRPC / HTTP (the order flips every pair). Two figures:

- ``search``: Search, k=10 (``POST /v1/search``): encode + shard + document fetch;
- ``get``: Get of one document (``GET /v1/documents/{id}``): one Redis read, no encoder,
  where the port's own cost shows most plainly.

Per figure and transport: p50/p99 latency over all calls, calls/s (median of the
rounds); ``p50_ratio``: the median over the pairs of rounds of HTTP p50 ÷ gRPC p50 in
the same pair (``pair_ratios``), and ``p50_overhead_ms`` (the same pairs, HTTP p50 − gRPC
p50). Prints a table and one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np

from bench import gateway_pair as pair


def _http_search(session: Any, base: str, queries: list[str]) -> pair.Call:
    async def call(i: int) -> Any:
        body = json.dumps({"query": queries[i % len(queries)], "k": 10}).encode()
        async with session.post(
            f"{base}/v1/search", data=body, headers={"Content-Type": "application/json"}
        ) as reply:
            data = await reply.read()
            if reply.status != 200:
                raise RuntimeError(f"HTTP search {reply.status}: {data[:300]!r}")
            return json.loads(data)

    return call


def _http_get(session: Any, base: str, ids: list[str]) -> pair.Call:
    async def call(i: int) -> Any:
        path = urllib.parse.quote(ids[i % len(ids)], safe="")
        async with session.get(f"{base}/v1/documents/{path}") as reply:
            data = await reply.read()
            if reply.status != 200:
                raise RuntimeError(f"HTTP get {reply.status}: {data[:300]!r}")
            return json.loads(data)

    return call


def _p50_ms(measured: pair.Round) -> float:
    return float(np.percentile(np.array(measured[1]) * 1000, 50))


def _compare(rounds: dict[str, list[pair.Round]]) -> dict[str, Any]:
    """Each transport's figures, and HTTP against gRPC by the p50 of each pair of rounds."""
    pairs = list(zip(rounds["http"], rounds["grpc"], strict=True))
    ratios = [_p50_ms(h) / _p50_ms(g) for h, g in pairs]
    overheads = [_p50_ms(h) - _p50_ms(g) for h, g in pairs]
    return {
        **{name: pair.figures(measured) for name, measured in rounds.items()},
        "p50_ratio": round(statistics.median(ratios), 3),
        "p50_overhead_ms": round(statistics.median(overheads), 2),
        "pair_ratios": [round(r, 3) for r in ratios],
    }


async def _measure(
    grpc_address: str, http_base: str, data: pair.SciFact, args: Any
) -> dict[str, Any]:
    import aiohttp
    import grpc

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with (
        grpc.aio.insecure_channel(grpc_address) as channel,
        aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(30)) as session,
    ):
        result: dict[str, Any] = {}
        for name, grpc_call, http_call, over in (
            ("search", pair.search_call, _http_search, data.queries),
            ("get", pair.get_call, _http_get, data.ids),
        ):
            calls = {"grpc": grpc_call(channel, over), "http": http_call(session, http_base, over)}
            compared = _compare(await pair.alternating_rounds(calls, args))
            result[name] = compared
            g, h = compared["grpc"], compared["http"]
            print(
                f"{name:<7} gRPC p50 {g['p50_ms']:7.2f} ms (p99 {g['p99_ms']:7.2f}, "
                f"{g['per_s']:6.1f}/s)   HTTP p50 {h['p50_ms']:7.2f} ms (p99 {h['p99_ms']:7.2f}, "
                f"{h['per_s']:6.1f}/s)   p50 ratio {compared['p50_ratio']:.3f} "
                f"(+{compared['p50_overhead_ms']:.2f} ms)",
                flush=True,
            )
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair.add_round_flags(parser)
    parser.set_defaults(concurrency=1)
    parser.add_argument("--out", type=Path, default=None, help="Also write the JSON line here.")
    args = parser.parse_args(argv)

    from tests.support.processes import free_port

    pair.check_prerequisites()
    with pair.work_dir("bench-http-overhead-", args.keep) as work:
        data = pair.load_scifact(args.docs)
        index_dir = pair.train(data, work)
        with pair.one_shard(index_dir, data, work) as (store, shard_proc):
            address = f"127.0.0.1:{free_port()}"
            http_port = free_port()
            argv_ = [
                *pair.gateway_argv(store.url, shard_proc.address, address),
                "--no-auth",
                "--http-port",
                str(http_port),
            ]
            with pair.process(argv_, work / "gateway.log") as proc:
                pair.wait_healthy(address, proc, work / "gateway.log", "gateway")
                base = f"http://127.0.0.1:{http_port}"
                result = asyncio.run(_measure(address, base, data, args))
    line = json.dumps(
        {
            "bench": "http_overhead",
            "search_p50_ratio": result["search"]["p50_ratio"],
            "search_p50_overhead_ms": result["search"]["p50_overhead_ms"],
            "get_p50_ratio": result["get"]["p50_ratio"],
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "seconds": args.seconds,
            "docs": len(data.docs),
            **result,
        }
    )
    if args.out is not None:
        args.out.write_text(line + "\n", encoding="utf-8")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
