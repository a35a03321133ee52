"""What the front door costs a search: bearer-token auth + admission control + TLS, as a
ratio to the same search on a plain gateway, measured in one run.

    .venv/bin/python -m bench.front_door [--rounds 6] [--seconds 4] [--concurrency 8]
        [--docs 5000]

One real stack: a redis-server, one index shard process (IVF-PQ trained on the SciFact
document embeddings of ``../shared/data``, the documents ingested through the change
log), and two gateway processes on that same shard and Redis, with the in-process
encoder (all-MiniLM-L6-v2), differing only in their front door:

- plain: ``--no-auth``, no ``--max-in-flight``, plaintext;
- front door: ``--read-tokens-file``/``--write-tokens-file`` (every call carries a
  bearer token, checked against both sets), ``--max-in-flight 256`` (admission counted
  on every call), and TLS on its port (``--tls-cert``/``--tls-key``; the client trusts
  the throwaway CA of ``services/stack/certs.py``).

The client (this process, grpc.aio, ``--concurrency`` calls in flight, one channel per
gateway, as a real client keeps) sends the same SciFact queries to both, in rounds that
alternate plain / front door (the order flips every pair) so both see the same machine
(``--together`` drives both at once instead). Two figures:

- ``search``: Search, k=10 (encode + shard + document fetch): the goal, ≥ 0.9;
- ``get``: Get of one document (one Redis read, no encoder): where a front-door cost
  would show most plainly.

Per figure: calls/s and p50/p99 latency of each gateway (medians over the rounds) and
``ratio``: the median over the rounds of front-door calls/s ÷ plain calls/s in the
same round (``pair_ratios``; ``ratio_of_medians`` beside it). The gateway → shard hop
is plaintext in both (the front door is what is measured; mTLS between our services is
not part of this figure). Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("GTR_DATA_DIR", ROOT.parent / "shared" / "data")) / "scifact"
TOKEN = "bench-front-door-token"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@contextmanager
def _process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait(ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, what: str) -> None:
    """Until ``ready()``; the log's tail if the process exits first."""
    from tests.support.processes import wait_until

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited:\n{log.read_text(errors='replace')[-3000:]}")
        return ready()

    wait_until(up, f"{what} healthy (log {log})", timeout=600, interval=0.1)


def _healthy(address: str, tls: Any = None) -> Callable[[], bool]:
    from services.stack.children import grpc_healthy

    return lambda: grpc_healthy(address, tls=tls)


def _ingest(redis_url: str, vectors: np.ndarray, docs: list[dict[str, Any]]) -> None:
    from services.index.client.writer import ChangeLogWriter, DocRecord

    async def run() -> None:
        writer = ChangeLogWriter.connect(redis_url, num_shards=1, dim=vectors.shape[1])
        for i in range(0, len(docs), 250):
            await writer.upsert(
                [
                    DocRecord(d["_id"], vectors[j], d.get("title", ""), d.get("text", ""))
                    for j, d in enumerate(docs[i : i + 250], start=i)
                ]
            )
        await writer.close()

    asyncio.run(run())


async def _round(
    call: Callable[[int], Any], concurrency: int, seconds: float
) -> tuple[float, list[float]]:
    """Closed loop: ``concurrency`` workers call for ``seconds``; (calls/s, latencies s)."""
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    counter = iter(range(1 << 62))

    async def worker() -> None:
        while time.perf_counter() < stop:
            start = time.perf_counter()
            await call(next(counter))
            latencies.append(time.perf_counter() - start)

    begin = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(latencies) / (time.perf_counter() - begin), latencies


def _figures(rounds: list[tuple[float, list[float]]]) -> dict[str, float]:
    rates = [r for r, _ in rounds]
    lat = np.array([x for _, xs in rounds for x in xs]) * 1000
    return {
        "per_s": round(statistics.median(rates), 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 2),
        "p99_ms": round(float(np.percentile(lat, 99)), 2),
        "rounds": [round(r, 1) for r in rates],  # type: ignore[dict-item]
    }


async def _measure(
    plain: str, front: str, certs: Any, queries: list[str], ids: list[str], args: Any
) -> dict[str, Any]:
    import grpc

    from retrieval.v1 import documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc
    from services.common.auth import bearer_metadata
    from services.common.tls import ClientTLS, aio_channel

    metadata = bearer_metadata(TOKEN)
    async with (
        grpc.aio.insecure_channel(plain) as plain_ch,
        aio_channel(front, ClientTLS(certs.ca)) as front_ch,
    ):
        targets = {"plain": (plain_ch, ()), "front_door": (front_ch, metadata)}

        def search(ch: grpc.aio.Channel, md: Any) -> Callable[[int], Any]:
            stub = search_pb2_grpc.SearchServiceStub(ch)
            return lambda i: stub.Search(
                search_pb2.SearchRequest(query=queries[i % len(queries)], k=10),
                timeout=30,
                metadata=md,
            )

        def get(ch: grpc.aio.Channel, md: Any) -> Callable[[int], Any]:
            stub = documents_pb2_grpc.DocumentServiceStub(ch)
            return lambda i: stub.Get(
                documents_pb2.GetRequest(id=ids[i % len(ids)]), timeout=30, metadata=md
            )

        result: dict[str, Any] = {}
        for name, make in (("search", search), ("get", get)):
            calls = {k: make(ch, md) for k, (ch, md) in targets.items()}
            for k in targets:  # warm-up: connections, handshakes, caches
                await _round(calls[k], args.concurrency, 1.0)
            rounds: dict[str, list[tuple[float, list[float]]]] = {k: [] for k in targets}
            for r in range(args.rounds):
                if args.together:
                    both = await asyncio.gather(
                        *(_round(calls[k], args.concurrency, args.seconds) for k in targets)
                    )
                    for k, measured in zip(targets, both, strict=True):
                        rounds[k].append(measured)
                    continue
                order = list(targets) if r % 2 == 0 else list(reversed(targets))
                for k in order:
                    rounds[k].append(await _round(calls[k], args.concurrency, args.seconds))
            figures = {k: _figures(v) for k, v in rounds.items()}
            # the two rounds of a pair ran at the same time (--together) or back to back:
            # the load of a shared machine drifts between pairs more than within one
            pairs = [
                f[0] / p[0] for f, p in zip(rounds["front_door"], rounds["plain"], strict=True)
            ]
            ratio = statistics.median(pairs)
            result[name] = {
                **figures,
                "ratio": round(ratio, 3),
                "pair_ratios": [round(r, 3) for r in pairs],
                "ratio_of_medians": round(
                    figures["front_door"]["per_s"] / figures["plain"]["per_s"], 3
                ),
            }
            print(
                f"{name:<7} plain {figures['plain']['per_s']:8.1f}/s "
                f"(p50 {figures['plain']['p50_ms']:.2f} ms, p99 {figures['plain']['p99_ms']:.2f})"
                f"   front door {figures['front_door']['per_s']:8.1f}/s "
                f"(p50 {figures['front_door']['p50_ms']:.2f} ms, "
                f"p99 {figures['front_door']['p99_ms']:.2f})   ratio {ratio:.3f}",
                flush=True,
            )
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="Rounds per gateway (alternating).")
    parser.add_argument("--seconds", type=float, default=4.0, help="Seconds per round.")
    parser.add_argument("--concurrency", type=int, default=8, help="Calls in flight.")
    parser.add_argument("--docs", type=int, default=5000, help="SciFact documents ingested.")
    parser.add_argument("--keep", action="store_true", help="Keep the work directory (logs).")
    parser.add_argument(
        "--together",
        action="store_true",
        help="Drive both gateways at the same time in each round (default: one after the "
        "other). Not a fair comparison on a loaded machine: the two processes do not get "
        "equal shares of the cores (one run gave a Get ratio of 4.5).",
    )
    args = parser.parse_args(argv)

    from services.index.core.train import TrainOptions, train_index
    from services.stack.certs import make_certs
    from tests.support.processes import free_port, redis_binary, run_redis
    from tests.support.shards import start_shard

    if not (DATA / "corpus.jsonl").exists():
        raise SystemExit(f"SciFact data not found at {DATA} (set GTR_DATA_DIR)")
    if redis_binary() is None:
        raise SystemExit("redis-server is not installed (scripts/bootstrap.sh)")
    work = Path(tempfile.mkdtemp(prefix="bench-front-door-"))
    lines = (DATA / "corpus.jsonl").read_text(encoding="utf-8").splitlines()[: args.docs]
    docs = [json.loads(line) for line in lines]
    vectors = np.load(DATA / "corpus.all-MiniLM-L6-v2.npy")[: len(docs)].astype(np.float32)
    queries = [
        json.loads(line)["text"]
        for line in (DATA / "queries.jsonl").read_text(encoding="utf-8").splitlines()[:300]
    ]
    print(f"training the index on {len(docs)} SciFact embeddings ...", flush=True)
    # a fixed nprobe: the same index for both gateways is all that matters here
    train_index(vectors, work / "index", TrainOptions(model="all-MiniLM-L6-v2", nprobe=16))
    certs = make_certs(work / "certs")
    tokens = work / "tokens"
    tokens.write_text(f"{TOKEN}\n", encoding="utf-8")
    try:
        with run_redis(work / "redis") as store:
            _ingest(store.url, vectors, docs)
            shard_proc = start_shard(
                index_dir=work / "index", redis_url=store.url, shard=0, shards=1,
                work_dir=work, settings={"search-threads": "0"}, timeout=600,
            )  # fmt: skip
            try:
                common = [
                    sys.executable, "-m", "services.gateway.server", "--redis-url", store.url,
                    "--shards", shard_proc.address, "--encoder", "inprocess",
                    "--log-level", "WARNING",
                ]  # fmt: skip
                plain = f"127.0.0.1:{free_port()}"
                front = f"localhost:{free_port()}"
                plain_argv = [*common, "--port", plain.rsplit(":", 1)[1], "--no-auth"]
                front_argv = [
                    *common, "--port", front.rsplit(":", 1)[1],
                    "--read-tokens-file", str(tokens), "--write-tokens-file", str(tokens),
                    "--max-in-flight", "256",
                    "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                ]  # fmt: skip
                from services.common.tls import ClientTLS

                with (
                    _process(plain_argv, work / "plain.log") as plain_proc,
                    _process(front_argv, work / "front.log") as front_proc,
                ):
                    _wait(_healthy(plain), plain_proc, work / "plain.log", "plain gateway")
                    _wait(
                        _healthy(front, ClientTLS(certs.ca)),
                        front_proc,
                        work / "front.log",
                        "front-door gateway",
                    )
                    result = asyncio.run(
                        _measure(plain, front, certs, queries, [d["_id"] for d in docs], args)
                    )
            finally:
                shard_proc.stop()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(
        json.dumps(
            {
                "bench": "front_door",
                "search_ratio": result["search"]["ratio"],
                "get_ratio": result["get"]["ratio"],
                "goal": 0.9,
                "concurrency": args.concurrency,
                "together": args.together,
                "rounds": args.rounds,
                "seconds": args.seconds,
                "docs": len(docs),
                **result,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
