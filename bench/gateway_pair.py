"""Two gateways on one shard and one Redis, driven by the same calls in alternating rounds:
the stack and the measuring loop that ``bench.front_door`` (a plain gateway against one
with auth + admission + TLS) and ``bench.generation_cost`` (the gateway from before index
generations against this tree's) share; each bench keeps what it compares and prints.

The stack: a redis-server, one index shard process (IVF-PQ trained on the first ``--docs``
SciFact document embeddings of ``../shared/data`` with a fixed nprobe: the same index
for both gateways is all that matters), the documents ingested through the change log.
The gateways use the in-process encoder (all-MiniLM-L6-v2).

The loop: a warm-up second per gateway, then ``--rounds`` closed-loop rounds per gateway
(``--concurrency`` calls in flight for ``--seconds``) that alternate, the order flipping
every pair, so both gateways see the same machine; the load of a shared machine drifts
between pairs more than within one, so the ratio is the median of the pairs' ratios.
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
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("GTR_DATA_DIR", ROOT.parent / "shared" / "data")) / "scifact"

Call = Callable[[int], Awaitable[Any]]
"""One call of a round, given its sequence number (to pick a query or an id)."""
Round = tuple[float, list[float]]
"""What one round measured: calls/s and each call's latency in seconds."""


def add_round_flags(parser: argparse.ArgumentParser) -> None:
    """--rounds, --seconds, --concurrency, --docs and --keep."""
    parser.add_argument("--rounds", type=int, default=6, help="Rounds per gateway (alternating).")
    parser.add_argument("--seconds", type=float, default=4.0, help="Seconds per round.")
    parser.add_argument("--concurrency", type=int, default=8, help="Calls in flight.")
    parser.add_argument("--docs", type=int, default=5000, help="SciFact documents ingested.")
    parser.add_argument("--keep", action="store_true", help="Keep the work directory (logs).")


# --- the stack ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SciFact:
    docs: list[dict[str, Any]]
    vectors: np.ndarray
    queries: list[str]

    @property
    def ids(self) -> list[str]:
        return [d["_id"] for d in self.docs]


def check_prerequisites() -> None:
    """SystemExit naming what is missing: the SciFact data or redis-server."""
    from tests.support.processes import redis_binary

    if not (DATA / "corpus.jsonl").exists():
        raise SystemExit(f"SciFact data not found at {DATA} (set GTR_DATA_DIR)")
    if redis_binary() is None:
        raise SystemExit("redis-server is not installed (scripts/bootstrap.sh)")


def load_scifact(docs: int) -> SciFact:
    """The first ``docs`` SciFact documents, their embeddings and 300 queries."""
    lines = (DATA / "corpus.jsonl").read_text(encoding="utf-8").splitlines()[:docs]
    records = [json.loads(line) for line in lines]
    vectors = np.load(DATA / "corpus.all-MiniLM-L6-v2.npy")[: len(records)].astype(np.float32)
    queries = [
        json.loads(line)["text"]
        for line in (DATA / "queries.jsonl").read_text(encoding="utf-8").splitlines()[:300]
    ]
    return SciFact(records, vectors, queries)


@contextmanager
def work_dir(prefix: str, keep: bool) -> Iterator[Path]:
    """A temporary work directory, removed at the end unless ``keep``."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def train(data: SciFact, work: Path) -> Path:
    """The IVF-PQ index of the documents' embeddings, in ``work/index``."""
    from services.index.core.train import TrainOptions, train_index

    print(f"training the index on {len(data.docs)} SciFact embeddings ...", flush=True)
    # a fixed nprobe: the same index for both gateways is all that matters here
    train_index(data.vectors, work / "index", TrainOptions(model="all-MiniLM-L6-v2", nprobe=16))
    return work / "index"


@contextmanager
def one_shard(index_dir: Path, data: SciFact, work: Path) -> Iterator[tuple[Any, Any]]:
    """A redis-server holding the documents (ingested through the change log) and one
    shard process serving ``index_dir``: (the Redis, the shard)."""
    from tests.support.processes import run_redis
    from tests.support.shards import start_shard

    with run_redis(work / "redis") as store:
        ingest(store.url, data.vectors, data.docs)
        shard = start_shard(
            index_dir=index_dir,
            redis_url=store.url,
            shard=0,
            shards=1,
            work_dir=work,
            settings={"search-threads": "0"},
            timeout=600,
        )
        try:
            yield store, shard
        finally:
            shard.stop()


def ingest(redis_url: str, vectors: np.ndarray, docs: list[dict[str, Any]]) -> None:
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


def gateway_argv(redis_url: str, shard_address: str, address: str) -> list[str]:
    """A gateway on the shard and Redis with the in-process encoder, listening on
    ``address``'s port; each bench adds its front-door flags."""
    return [
        sys.executable,
        "-m",
        "services.gateway.server",
        "--redis-url",
        redis_url,
        "--shards",
        shard_address,
        "--encoder",
        "inprocess",
        "--log-level",
        "WARNING",
        "--port",
        address.rsplit(":", 1)[1],
    ]


@contextmanager
def process(argv: list[str], log: Path, root: Path = ROOT) -> Iterator[subprocess.Popen[bytes]]:
    """A process run from the source tree ``root`` (its output in ``log``), terminated at
    the end."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), str(root / "clients" / "python")]),
        "OMP_NUM_THREADS": "1",
    }
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_healthy(
    address: str, proc: subprocess.Popen[bytes], log: Path, what: str, tls: Any = None
) -> None:
    """Until the gRPC health service at ``address`` answers SERVING; the log's tail if the
    process exits first."""
    from services.stack.children import grpc_healthy
    from tests.support.processes import wait_until

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited:\n{log.read_text(errors='replace')[-3000:]}")
        return grpc_healthy(address, tls=tls)

    wait_until(up, f"{what} healthy (log {log})", timeout=600, interval=0.1)


# --- the calls and the rounds --------------------------------------------------------------


def search_call(channel: Any, queries: list[str], metadata: Any = None) -> Call:
    """Search, k=10 (in the gateway's default mode), the queries in turn."""
    from retrieval.v1 import search_pb2, search_pb2_grpc

    stub = search_pb2_grpc.SearchServiceStub(channel)
    return lambda i: stub.Search(
        search_pb2.SearchRequest(query=queries[i % len(queries)], k=10),
        timeout=30,
        metadata=metadata,
    )


def get_call(channel: Any, ids: list[str], metadata: Any = None) -> Call:
    """Get of one document, the ids in turn."""
    from retrieval.v1 import documents_pb2, documents_pb2_grpc

    stub = documents_pb2_grpc.DocumentServiceStub(channel)
    return lambda i: stub.Get(
        documents_pb2.GetRequest(id=ids[i % len(ids)]), timeout=30, metadata=metadata
    )


async def closed_loop(call: Call, concurrency: int, seconds: float) -> Round:
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


async def alternating_rounds(
    calls: dict[str, Call],
    args: argparse.Namespace,
    together: bool = False,
    around: Callable[[str], AbstractContextManager[Any]] | None = None,
) -> dict[str, list[Round]]:
    """A warm-up second per gateway (connections, handshakes, caches), then
    ``args.rounds`` rounds of each (``args.concurrency`` calls in flight for
    ``args.seconds``), in the order of ``calls`` on even rounds and reversed on odd ones;
    ``together``: each round drives them all at once instead. ``around(name)``, when
    given, is entered around each of that gateway's rounds (one after the other only)."""
    if together and around is not None:
        raise ValueError("around() needs the rounds one after the other")
    names = list(calls)
    for name in names:
        await closed_loop(calls[name], args.concurrency, 1.0)
    rounds: dict[str, list[Round]] = {name: [] for name in names}
    for r in range(args.rounds):
        if together:
            both = await asyncio.gather(
                *(closed_loop(calls[n], args.concurrency, args.seconds) for n in names)
            )
            for name, measured in zip(names, both, strict=True):
                rounds[name].append(measured)
            continue
        for name in names if r % 2 == 0 else reversed(names):
            with around(name) if around is not None else nullcontext():
                rounds[name].append(await closed_loop(calls[name], args.concurrency, args.seconds))
    return rounds


def figures(rounds: list[Round]) -> dict[str, Any]:
    """One gateway's rounds: median calls/s, p50/p99 latency over all its calls (ms), and
    each round's calls/s."""
    rates = [r for r, _ in rounds]
    lat = np.array([x for _, xs in rounds for x in xs]) * 1000
    return {
        "per_s": round(statistics.median(rates), 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 2),
        "p99_ms": round(float(np.percentile(lat, 99)), 2),
        "rounds": [round(r, 1) for r in rates],
    }


def compare(rounds: dict[str, list[Round]], new: str, base: str) -> dict[str, Any]:
    """Each gateway's :func:`figures`, ``ratio`` (the median over the pairs of rounds of
    ``new`` calls/s ÷ ``base`` calls/s) and ``pair_ratios``."""
    pairs = [n[0] / b[0] for n, b in zip(rounds[new], rounds[base], strict=True)]
    return {
        **{name: figures(measured) for name, measured in rounds.items()},
        "ratio": round(statistics.median(pairs), 3),
        "pair_ratios": [round(p, 3) for p in pairs],
    }


def json_line(bench: str, result: dict[str, Any], args: Any, docs: int, **own: Any) -> str:
    """The JSON line a bench prints last: its name, the search and Get ratios of
    ``result`` (per call kind, a :func:`compare`), the bench's ``own`` figures, the rounds'
    settings, the documents ingested, then every figure of ``result``."""
    return json.dumps(
        {
            "bench": bench,
            "search_ratio": result["search"]["ratio"],
            "get_ratio": result["get"]["ratio"],
            **own,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "seconds": args.seconds,
            "docs": docs,
            **result,
        }
    )
