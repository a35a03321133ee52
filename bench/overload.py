"""Admission under a burst: how a gateway at ``--max-in-flight`` answers far more
concurrent searches than its limit, with large answers and with small ones, measured in
one run.

    .venv/bin/python -m bench.overload [--calls 1000] [--limit 32] [--timeout 5]
        [--docs 2000] [--big-k 1000] [--small-k 10]

One real stack: a redis-server, one index shard process (IVF-PQ trained on the SciFact
document embeddings of ``../shared/data``, ``--docs`` documents with their texts ingested
through the change log) and one gateway process (in-process encoder, ``--no-auth``,
``--max-in-flight --limit``). The client (this process, grpc.aio, 8 channels) sends
``--calls`` Search calls at once, each with a ``--timeout`` deadline, first at
``--small-k`` (the baseline: small answers), then at ``--big-k`` (answers of ~1 MB), and
counts the status codes. The goal: overload is answered RESOURCE_EXHAUSTED with
``retry-after-ms`` early whatever k is: no DEADLINE_EXCEEDED, and a refusal at big k
about as quick as at small k (``refusal_p99_ratio``: big-k p99 time to a refusal ÷
small-k's, measured in the same run). ``--baseline-src DIR``: the same big-k burst, in the
same run and against the same Redis and shard, first sent to a gateway started from the
source tree DIR (``git archive <commit> | tar -x -C DIR``: the code before a change), so
the summary holds the before and after figures side by side. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("GTR_DATA_DIR", ROOT.parent / "shared" / "data")) / "scifact"
CHANNELS = 8


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def _burst(address: str, calls: int, k: int, timeout: float) -> dict[str, Any]:
    import grpc

    from retrieval.v1 import search_pb2, search_pb2_grpc

    # one connection per channel (gRPC shares one between same-target channels by default)
    local = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=local) for _ in range(CHANNELS)]
    try:
        stubs = [search_pb2_grpc.SearchServiceStub(c) for c in channels]
        outside: list[float] = []  # an OK call's time outside the gateway's handler
        for stub in stubs:  # connected before the burst: the burst measures the gateway
            await stub.Search(search_pb2.SearchRequest(query="warm up", k=1), timeout=60)

        async def one(i: int) -> tuple[str, float, bool]:
            request = search_pb2.SearchRequest(query=f"protein folding {i % 50}", k=k)
            start = time.perf_counter()
            try:
                reply = await stubs[i % CHANNELS].Search(request, timeout=timeout)
                took = time.perf_counter() - start
                outside.append(took - reply.timings.total_ms / 1000.0)
                return "OK", took, False
            except grpc.aio.AioRpcError as exc:
                trailing = dict(exc.trailing_metadata() or ())
                hinted = "retry-after-ms" in trailing
                return exc.code().name, time.perf_counter() - start, hinted

        start = time.perf_counter()
        results = await asyncio.gather(*[one(i) for i in range(calls)])
        wall = time.perf_counter() - start
    finally:
        for channel in channels:
            await channel.close()
    codes: dict[str, int] = {}
    for code, _, _ in results:
        codes[code] = codes.get(code, 0) + 1
    refused = [s for code, s, _ in results if code == "RESOURCE_EXHAUSTED"]
    ok = [s for code, s, _ in results if code == "OK"]
    return {
        "k": k,
        "codes": codes,
        "refused_with_hint": sum(1 for code, _, h in results if code == "RESOURCE_EXHAUSTED" and h),
        "refusal_p50_s": _percentile(refused, 50),
        "refusal_p99_s": _percentile(refused, 99),
        "ok_p50_s": _percentile(ok, 50),
        "ok_p99_s": _percentile(ok, 99),
        "ok_outside_handler_p50_s": _percentile(outside, 50),
        "wall_s": wall,
    }


def _ingest(address: str, docs: int) -> None:
    """The documents through the gateway's Upsert, as a client writes them."""
    import grpc

    from retrieval.v1 import documents_pb2, documents_pb2_grpc

    lines = (DATA / "corpus.jsonl").read_text().splitlines()[:docs]
    rows = [json.loads(line) for line in lines]
    with grpc.insecure_channel(address) as channel:
        stub = documents_pb2_grpc.DocumentServiceStub(channel)
        for i in range(0, docs, 200):
            batch = [
                documents_pb2.Document(id=f"d{j}", title=rows[j]["title"], text=rows[j]["text"])
                for j in range(i, min(i + 200, docs))
            ]
            stub.Upsert(documents_pb2.UpsertRequest(documents=batch), timeout=600)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--limit", type=int, default=32, help="the gateway's --max-in-flight")
    parser.add_argument("--timeout", type=float, default=5.0, help="each call's deadline (s)")
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--big-k", type=int, default=1000)
    parser.add_argument("--small-k", type=int, default=10)
    parser.add_argument(
        "--profile", type=Path, help="run the gateway under cProfile, its stats to this file"
    )
    parser.add_argument("--only-big", action="store_true", help="skip the small-k burst")
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="also burst a gateway run from this source tree (the code before a change)",
    )
    args = parser.parse_args(argv)

    from tests.support.processes import free_port, run_redis, stop_process
    from tests.support.shards import start_shard, train_test_index

    with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp_name:
        tmp = Path(tmp_name)
        with run_redis(tmp / "redis") as store:
            vectors = np.load(DATA / "corpus.all-MiniLM-L6-v2.npy")[:5000].astype(np.float32)
            index_dir = train_test_index(vectors, tmp / "index", nlist=16, nprobe=16)
            shard = start_shard(
                index_dir=index_dir, redis_url=store.url, shard=0, shards=1, work_dir=tmp
            )
            log = (tmp / "gateway.log").open("ab")

            def start_gateway(root: Path) -> tuple[subprocess.Popen[bytes], int]:
                port = free_port()
                env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
                return subprocess.Popen(
                    [
                        sys.executable,
                        *(["-m", "cProfile", "-o", str(args.profile)] if args.profile else []),
                        "-m", "services.gateway.server", "--port", str(port),
                        "--redis-url", store.url, "--shards", shard.address,
                        "--encoder", "inprocess", "--no-auth", "--log-level", "WARNING",
                        "--max-in-flight", str(args.limit),
                    ],
                    cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                ), port  # fmt: skip

            before: dict[str, Any] | None = None
            gateway, port = start_gateway(ROOT)
            try:
                from tests.support.processes import wait_for_port

                wait_for_port(port, timeout=120)
                address = f"127.0.0.1:{port}"
                _ingest(address, args.docs)
                if args.baseline_src is not None:
                    old, old_port = start_gateway(args.baseline_src.resolve())
                    try:
                        wait_for_port(old_port, timeout=120)
                        before = asyncio.run(
                            _burst(f"127.0.0.1:{old_port}", args.calls, args.big_k, args.timeout)
                        )
                        print(json.dumps({"before": before}), flush=True)
                    finally:
                        stop_process(old)
                small = (
                    {"k": args.small_k, "codes": {}, "refusal_p99_s": None}
                    if args.only_big
                    else asyncio.run(_burst(address, args.calls, args.small_k, args.timeout))
                )
                print(json.dumps(small), flush=True)
                big = asyncio.run(_burst(address, args.calls, args.big_k, args.timeout))
                print(json.dumps(big), flush=True)
            finally:
                stop_process(gateway)
                log.close()
                shard.stop()
    ratio = (
        big["refusal_p99_s"] / small["refusal_p99_s"]
        if big["refusal_p99_s"] and small["refusal_p99_s"]
        else None
    )
    summary = {
        "calls": args.calls,
        "limit": args.limit,
        "timeout_s": args.timeout,
        "small": small,
        "big": big,
        "big_deadline_exceeded": big["codes"].get("DEADLINE_EXCEEDED", 0),
        "refusal_p99_ratio": ratio,
    }
    if before is not None:
        summary["before_big"] = before
        summary["before_big_deadline_exceeded"] = before["codes"].get("DEADLINE_EXCEEDED", 0)
        summary["refusal_p50_before_over_after"] = (
            before["refusal_p50_s"] / big["refusal_p50_s"]
            if before["refusal_p50_s"] and big["refusal_p50_s"]
            else None
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
