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
the summary holds the before and after figures side by side (repeat the flag for several
trees, e.g. alternating before/after). Each burst also holds ``gateway_handled``: the
gateway's own ``grpc_server_handled_total`` of Search by code over the burst (scraped
from its ``--metrics-port``; it includes the 8 warm-up calls), i.e. the calls that reached
its interceptor: the client's count less these waited in gRPC to be accepted.
``--py-spy DIR`` records the gateway and this client (all threads, idle ones too, native
frames) during the big-k burst, one speedscope file each. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
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


@contextlib.contextmanager
def _spied(folder: Path | None, pids: dict[str, int]) -> Iterator[None]:
    """py-spy records each of ``pids`` (all threads, idle ones too, native frames) while
    the block runs; one speedscope file per process in ``folder``."""
    if folder is None:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).with_name("py-spy")
    options = ["--threads", "--idle", "--native", "--rate", "200", "--format", "speedscope"]
    recorders = [
        subprocess.Popen(
            [str(spy), "record", "--pid", str(pid), *options, "-o", str(folder / f"{name}.json")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in pids.items()
    ]
    time.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        for recorder in recorders:
            recorder.send_signal(signal.SIGINT)
        for recorder in recorders:
            recorder.wait(timeout=60)


def _handled(metrics_port: int) -> dict[str, int]:
    """The gateway's ``grpc_server_handled_total`` of Search, by code: the calls that
    reached its interceptor (the client's count less these never got that far)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "grpc_server_handled":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("method") == "Search":
                code = sample.labels["code"]
                counts[code] = counts.get(code, 0) + int(sample.value)
    return counts


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
        "--py-spy",
        type=Path,
        help="record the gateway and this client with py-spy during the big-k burst"
        " (speedscope files in this folder)",
    )
    parser.add_argument(
        "--baseline-src",
        type=Path,
        action="append",
        default=[],
        help="also burst a gateway run from this source tree (the code before a change);"
        " may be given more than once",
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

            def start_gateway(root: Path) -> tuple[subprocess.Popen[bytes], int, int]:
                port, metrics = free_port(), free_port()
                env = {
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join([str(root), str(root / "clients" / "python")]),
                    "OMP_NUM_THREADS": "1",
                }
                return (
                    subprocess.Popen(
                        [
                            sys.executable,
                            *(["-m", "cProfile", "-o", str(args.profile)] if args.profile else []),
                            "-m",
                            "services.gateway.server",
                            "--port",
                            str(port),
                            "--redis-url",
                            store.url,
                            "--shards",
                            shard.address,
                            "--encoder",
                            "inprocess",
                            "--no-auth",
                            "--log-level",
                            "WARNING",
                            "--max-in-flight",
                            str(args.limit),
                            "--metrics-port",
                            str(metrics),
                        ],
                        cwd=root,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    ),
                    port,
                    metrics,
                )

            def burst(port: int, metrics: int, k: int) -> dict[str, Any]:
                """One burst, and what the gateway's own metrics saw of it."""
                seen = _handled(metrics)
                result = asyncio.run(_burst(f"127.0.0.1:{port}", args.calls, k, args.timeout))
                after = _handled(metrics)
                result["gateway_handled"] = {
                    code: after[code] - seen.get(code, 0)
                    for code in after
                    if after[code] > seen.get(code, 0)
                }
                return result

            baselines: list[dict[str, Any]] = []
            gateway, port, metrics = start_gateway(ROOT)
            try:
                from tests.support.processes import wait_for_port

                wait_for_port(port, timeout=120)
                address = f"127.0.0.1:{port}"
                _ingest(address, args.docs)
                for src in args.baseline_src:
                    old, old_port, old_metrics = start_gateway(src.resolve())
                    try:
                        wait_for_port(old_port, timeout=120)
                        before = burst(old_port, old_metrics, args.big_k)
                        baselines.append({"src": str(src), **before})
                        print(json.dumps({"before": baselines[-1]}), flush=True)
                    finally:
                        stop_process(old)
                small = (
                    {"k": args.small_k, "codes": {}, "refusal_p99_s": None}
                    if args.only_big
                    else burst(port, metrics, args.small_k)
                )
                print(json.dumps(small), flush=True)
                with _spied(args.py_spy, {"gateway": gateway.pid, "client": os.getpid()}):
                    big = burst(port, metrics, args.big_k)
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
    if baselines:
        before = baselines[0]
        summary["baselines"] = baselines
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
