"""Hybrid retrieval through the service against its baselines, measured in one run.

    .venv/bin/python -m bench.hybrid [--seconds 8] [--rate 150] [--rounds 3] [--clients 16,32,64]
        [--loads quiet,one_core_busy]

Real processes: a Redis (AOF ``appendfsync always``) and 2 shard servers (``index
serve``, inline search), fed through the change log with the 5,183 SciFact documents
(title + text, the all-MiniLM-L6-v2 embeddings of ``../shared/data``), queried through
the router with the 809 SciFact train queries (their embeddings cached by the index
bench). Figures (the last line is JSON; ``bench/results/hybrid.json`` keeps it for
``gtr-retrieval plan``):

- ``sparse_qps`` / ``raw_sparse_qps`` = ``sparse_ratio``: BM25 searches per second through
  the service (closed loop: concurrent clients, one query each, top 10; the router
  coalesces them) against Tantivy searched in this process on the same documents (one
  index, the shard's own analyzer and query, one query at a time, one thread); the rounds
  alternate the two. The service's figure is its throughput: the highest over
  ``--clients`` (16, 32 and 64 concurrent clients; ``sparse_clients`` says which). With 16
  the loop is bound by each wave's round trip, not by the CPU (2026-11-30: 4,209 q/s at
  1.39 busy cores, 64 clients 6,153 q/s at 1.56), so ``sparse_by_clients`` keeps every
  level: its searches/s, ratio to the same rounds' in-process figure, and the CPU per
  search of the bench's processes (``cpu_ms_per_query``: this one, the shards, Redis; not
  the ``one_core_busy`` spinner; in process one thread: ``1000 / raw_sparse_qps``).
- ``hybrid_p99_over_dense``: p99 of a hybrid search (dense and BM25 top 100 each in one
  fan-out, fused as the gateway fuses, top 10) over the p99 of a dense search (top 10)
  at the same offered load (``--rate`` Poisson arrivals per second, open loop). The two
  run in alternating windows (``--windows`` of ``--window-s`` each, the order swapped
  every round) and each p99 is over all its windows' latencies: the machine's drift
  (other jobs on the shared cores move a p99 by 5x within minutes) falls on both alike.
  ``hybrid_p99_over_dense_ci95``: its 95 % interval, a bootstrap that resamples each
  mode's windows (``bench/p99_interval.py``); quiet runs on different days read
  1.45-2.37.
- **Loads** (``--loads``, default both): ``quiet`` measures the figures above with nothing
  else of the bench running; ``one_core_busy`` measures them again beside a process that
  keeps one core busy (a spin loop at the default priority: another job on the machine).
  The JSON keeps both under ``loads`` (the quiet run's figures also at the top level), with
  the machine's busy cores and what the rest of it used (``other_cores``) during each.
- ``text_bytes_per_document``: the shards' text index on disk (``Stats``) per document,
  beside ``bytes_per_vector`` of the IVF-PQ index; ``text_doc_bytes``: mean title + text
  bytes of the corpus (the plan scales by it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench import cpu_roles
from bench.index_service import SCIFACT, query_embeddings, say
from bench.p99_interval import p99_ratio_interval
from retrieval.v1 import index_pb2, index_pb2_grpc
from services.common.fusion import Fusion, Method, fuse_hits
from services.corpus.beir import load_beir
from services.index.client.router import ShardRouter
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.query import IndexQuery
from services.index.core.text import TextDoc, TextIndex
from services.index.core.train import TrainOptions, train_index
from tests.support.processes import run_redis
from tests.support.shards import run_shards

RESULT = Path(__file__).resolve().parent / "results" / "hybrid.json"
SHARDS = 2
CANDIDATES = 100  # each list's depth in a hybrid search (the gateway's default)


def in_process_index(directory: Path, ids: list[str], bodies: list[str]) -> TextIndex:
    """One Tantivy index of every document, as a shard builds its own."""
    text = TextIndex.create(directory)
    text.apply([], [TextDoc(i, body, {}) for i, body in enumerate(bodies)])
    assert len(text) == len(ids)
    return text


def raw_sparse_qps(text: TextIndex, queries: list[str], seconds: float) -> float:
    """Tantivy in this process, one query at a time: analyse, search top 10, read ids."""
    n, start = 0, time.perf_counter()
    stop = start + seconds
    while time.perf_counter() < stop:
        text.search([text.terms(queries[n % len(queries)])], 10)
        n += 1
    return n / (time.perf_counter() - start)


async def warm_sparse(router: ShardRouter, queries: list[str]) -> None:
    for q in queries[:50]:  # warm the channels
        await router.search(IndexQuery(None, 0, texts=(q,), sparse_k=10), timeout=5)


def service_cpu_s(spinner: int | None) -> float:
    """CPU seconds so far of the bench's processes (this one, Redis, the shards) but the
    ``one_core_busy`` spinner's."""
    used = cpu_roles.sample(os.getpid())
    total = sum(v for k, v in used.items() if k not in ("machine", "steal"))
    stat = cpu_roles.read_stat(f"/proc/{spinner}/stat") if spinner else None
    return total - (stat[2] if stat else 0.0)


async def service_sparse_qps(
    router: ShardRouter, queries: list[str], seconds: float, clients: int = 16
) -> float:
    done = 0

    async def client(offset: int) -> None:
        nonlocal done
        i = offset
        while time.perf_counter() < stop:
            query = IndexQuery(None, 0, texts=(queries[i % len(queries)],), sparse_k=10)
            await router.search(query, timeout=5)
            done += 1
            i += clients

    start = time.perf_counter()
    stop = start + seconds
    await asyncio.gather(*[client(c) for c in range(clients)])
    return done / (time.perf_counter() - start)


async def open_loop(
    router: ShardRouter,
    vectors: np.ndarray,
    texts: list[str],
    hybrid: bool,
    rate: float,
    seconds: float,
    seed: int,
) -> list[float]:
    """The latencies (s) of searches sent at Poisson arrivals of ``rate``/s for
    ``seconds``."""
    rng = random.Random(seed)
    latencies: list[float] = []
    fusion = Fusion(Method.WEIGHTED)

    async def one(i: int) -> None:
        t = time.perf_counter()
        if hybrid:
            query = IndexQuery(
                vectors[i : i + 1], CANDIDATES, texts=(texts[i],), sparse_k=CANDIDATES
            )
            r = await router.search(query, timeout=5)
            assert r.sparse is not None
            fuse_hits(r.hits[0], r.sparse[0], fusion, 10)  # as the gateway fuses its hits
        else:
            await router.search(IndexQuery(vectors[i : i + 1], 10), timeout=5)
        latencies.append(time.perf_counter() - t)

    tasks = []
    start = time.perf_counter()
    next_at = start
    i = rng.randrange(len(texts))
    while next_at - start < seconds:
        next_at += rng.expovariate(rate)
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i % len(texts))))
        i += 1
    await asyncio.gather(*tasks)
    return latencies


LOADS = ("quiet", "one_core_busy")


def _spin(stop: Any) -> None:
    """Keep one core busy until ``stop`` is set (another job on the machine)."""
    n = 0
    while not stop.is_set():
        for _ in range(100_000):
            n += 1


@contextmanager
def load(name: str) -> Iterator[int | None]:
    """Nothing beside the bench (``quiet``), or one spinning process (``one_core_busy``):
    its pid."""
    if name == "quiet":
        yield None
        return
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    spinner = ctx.Process(target=_spin, args=(stop,), daemon=True)
    spinner.start()
    try:
        yield spinner.pid
    finally:
        stop.set()
        spinner.join(10)
        if spinner.is_alive():
            spinner.kill()


def shard_stats(addresses: list[list[str]]) -> list[index_pb2.ShardStats]:
    out = []
    for replicas in addresses:
        with grpc.insecure_channel(replicas[0]) as channel:
            stub = index_pb2_grpc.IndexShardServiceStub(channel)
            out.append(stub.Stats(index_pb2.ShardStatsRequest(), timeout=30))
    return out


async def ingest(url: str, records: list[DocRecord]) -> float:
    writer = ChangeLogWriter.connect(url, SHARDS, dim=records[0].vector.shape[0])
    start = time.perf_counter()
    try:
        for i in range(0, len(records), 256):
            token = await writer.upsert(records[i : i + 256])
    finally:
        await writer.close()
    del token
    return len(records) / (time.perf_counter() - start)


async def sparse_figures(
    router: ShardRouter,
    text: TextIndex,
    queries: list[str],
    args: argparse.Namespace,
    spinner: int | None,
) -> dict[str, Any]:
    """The sparse throughput figures (docstring): each round Tantivy in process, then the
    service at every ``--clients`` level, the CPU of the bench's processes but ``spinner``
    (the ``one_core_busy`` load's pid) sampled around each."""
    raw: list[float] = []
    service: dict[int, list[float]] = {c: [] for c in args.clients}
    cpu_ms: dict[int, list[float]] = {c: [] for c in args.clients}
    for r in range(args.rounds):
        raw.append(raw_sparse_qps(text, queries, args.seconds))
        for clients in args.clients:
            await warm_sparse(router, queries)
            before, start = service_cpu_s(spinner), time.monotonic()
            qps = await service_sparse_qps(router, queries, args.seconds, clients)
            used = service_cpu_s(spinner) - before
            service[clients].append(qps)
            cpu_ms[clients].append(1000 * used / (qps * (time.monotonic() - start)))
        levels = ", ".join(f"{c} clients {service[c][-1]:.0f}" for c in args.clients)
        say(f"round {r + 1}: sparse raw {raw[-1]:.0f} q/s, service {levels} q/s")
    raw_m = statistics.median(raw)
    by = {
        c: {
            "qps": round(statistics.median(service[c]), 1),
            "ratio": round(statistics.median(service[c]) / raw_m, 3),
            "cpu_ms_per_query": round(statistics.median(cpu_ms[c]), 3),
        }
        for c in args.clients
    }
    best = max(args.clients, key=lambda c: by[c]["qps"])
    return {
        "raw_sparse_qps": round(raw_m, 1),
        "sparse_qps": by[best]["qps"],
        "sparse_ratio": by[best]["ratio"],
        "sparse_clients": best,
        "sparse_rounds_ratio": [round(s / r, 3) for s, r in zip(service[best], raw, strict=True)],
        "sparse_by_clients": {str(c): v for c, v in by.items()},
    }


async def measure(
    addresses: list[list[str]],
    text: TextIndex,
    queries: list[str],
    qvecs: np.ndarray,
    args: argparse.Namespace,
    spinner: int | None,
) -> dict[str, Any]:
    router = ShardRouter(addresses)
    latencies: dict[bool, list[float]] = {False: [], True: []}
    blocks: dict[bool, list[float]] = {False: [], True: []}  # each latency's window
    try:
        sparse = await sparse_figures(router, text, queries, args, spinner)
        for w in range(args.windows):
            for hybrid in (False, True) if w % 2 == 0 else (True, False):
                got = await open_loop(router, qvecs, queries, hybrid, args.rate, args.window_s, w)
                latencies[hybrid] += got
                blocks[hybrid] += [float(w)] * len(got)
            if (w + 1) % 5 == 0:
                d, h = (float(np.percentile(latencies[x], 99) * 1000) for x in (False, True))
                say(f"{w + 1} windows: p99 dense {d:.1f} ms, hybrid {h:.1f} ms")
    finally:
        await router.close()
    p50 = {x: float(np.percentile(latencies[x], 50) * 1000) for x in (False, True)}
    dense_m, hybrid_m = (float(np.percentile(latencies[x], 99) * 1000) for x in (False, True))
    # each window one block: a window's searches share its spell of the machine
    interval = p99_ratio_interval(
        (blocks[False], latencies[False]), (blocks[True], latencies[True]), block_s=1.0
    )
    return {
        **sparse,
        "offered_rate_per_s": args.rate,
        "windows": args.windows,
        "window_s": args.window_s,
        "searches_per_mode": len(latencies[False]),
        "dense_p50_ms": round(p50[False], 2),
        "hybrid_p50_ms": round(p50[True], 2),
        "dense_p99_ms": round(dense_m, 2),
        "hybrid_p99_ms": round(hybrid_m, 2),
        "hybrid_p99_over_dense": round(hybrid_m / dense_m, 3),
        "hybrid_p99_over_dense_ci95": [round(v, 3) for v in interval] if interval else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="Per QPS figure and round.")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds of the QPS figures.")
    parser.add_argument("--rate", type=float, default=100.0, help="Offered searches/s.")
    parser.add_argument("--windows", type=int, default=20, help="Alternating p99 windows.")
    parser.add_argument("--window-s", type=float, default=3.0, help="Seconds per window.")
    parser.add_argument("--no-save", action="store_true", help=f"Do not write {RESULT}.")
    parser.add_argument(
        "--clients",
        default="16,32,64",
        help="comma-separated concurrent clients of the sparse throughput figure (its "
        "highest is sparse_qps)",
    )
    parser.add_argument(
        "--loads",
        default=",".join(LOADS),
        help="comma-separated: quiet (nothing beside the bench), one_core_busy (a process "
        "spinning on one core beside it)",
    )
    args = parser.parse_args()
    args.loads = [x for x in args.loads.split(",") if x]
    try:
        args.clients = [int(c) for c in args.clients.split(",") if c]
    except ValueError:
        parser.error("--clients: comma-separated whole numbers")
    if not args.clients or min(args.clients) < 1:
        parser.error("--clients: one or more numbers of at least 1")
    if not args.loads or set(args.loads) - set(LOADS):
        parser.error(f"--loads: one or more of {', '.join(LOADS)}")

    beir = load_beir(SCIFACT)
    ids = beir.doc_ids
    vectors = np.load(SCIFACT / "corpus.all-MiniLM-L6-v2.npy")
    corpus = {}
    with (SCIFACT / "corpus.jsonl").open(encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            corpus[row["_id"]] = (row.get("title", ""), row.get("text", ""))
    qids, qvecs = query_embeddings()
    queries = [beir.queries[q] for q in qids]
    records = [DocRecord(d, vectors[i], corpus[d][0], corpus[d][1]) for i, d in enumerate(ids)]
    bodies = [beir.docs[d] for d in ids]
    doc_bytes = statistics.mean(len(b.encode("utf-8")) for b in bodies)

    with tempfile.TemporaryDirectory(prefix="gtr-hybrid-") as tmp_name:
        tmp = Path(tmp_name)
        say("training the index ...")
        train_index(vectors, tmp / "index", TrainOptions(model="all-MiniLM-L6-v2"))
        text = in_process_index(tmp / "text", ids, bodies)
        with run_redis(tmp / "redis") as redis_server:
            per_s = asyncio.run(ingest(redis_server.url, records))
            say(f"logged {len(records)} documents ({per_s:.0f}/s); starting {SHARDS} shards ...")
            settings = {"search-threads": "0", "omp-threads": "1", "log-level": "WARNING"}
            with run_shards(
                tmp / "index",
                redis_server.url,
                tmp / "work",
                shards=SHARDS,
                settings=settings,
                timeout=600,
            ) as cluster:
                stats = shard_stats(cluster.addresses)
                loads: dict[str, dict[str, Any]] = {}
                for name in args.loads:
                    say(f"== {name}")
                    with load(name) as spinner:
                        before, start = cpu_roles.sample(os.getpid()), time.monotonic()
                        figures = asyncio.run(
                            measure(cluster.addresses, text, queries, qvecs, args, spinner)
                        )
                        after, seconds = cpu_roles.sample(os.getpid()), time.monotonic() - start
                    busy = (after["machine"] - before["machine"]) / seconds
                    # every process of the bench: itself, the spinner, Redis, the shards
                    used = {k: (after[k] - before.get(k, 0.0)) / seconds for k in after}
                    figures["machine_cores"] = round(busy, 3)
                    figures["steal_cores"] = round(used["steal"], 3)
                    figures["other_cores"] = round(cpu_roles.with_other(used)["other"], 3)
                    loads[name] = figures
                    say(json.dumps(figures))
    documents = sum(s.text_documents for s in stats)
    text_bytes = sum(s.text_disk_bytes for s in stats)
    result = {
        "documents": len(ids),
        "queries": len(queries),
        "shards": SHARDS,
        **loads.get("quiet", next(iter(loads.values()))),
        "loads": loads,
        "text_documents": documents,
        "text_bytes_per_document": round(text_bytes / max(1, documents), 1),
        "text_doc_bytes": round(doc_bytes, 1),
        "bytes_per_vector": stats[0].bytes_per_vector,
        "goals": {"sparse_ratio": ">= 0.7", "hybrid_p99_over_dense": "<= 1.3"},
        "source": {
            "bench": "bench.hybrid",
            "run": time.strftime("%Y-%m-%d", time.gmtime()),
            "note": "2 cores shared by the client, the shards and Redis; loads.*.other_cores: "
            "what the rest of the machine used meanwhile (not the bench's processes, its "
            "spinner included)",
        },
    }
    line = json.dumps(result)
    if not args.no_save:
        RESULT.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
