"""The floor of a search's CPU, and the local stack's CPU per search as a ratio to it
(issue #34 points 1 and 4; docs/performance.md "The floor").

**The floor**: the same searches as the stack serves, with no RPC at all. One process, one
thread: the query encoded by the same ONNX export in ONNX Runtime (1 thread), each shard's
IVF-PQ search (SQ8 refine, the trained nprobe) and Tantivy BM25 search on the shards the
stack would hold (the same documents, split by :func:`~services.index.core.ids.shard_of`,
each shard's index trained with ``index train``'s defaults), the lists merged over the
shards, fused (:func:`~services.common.fusion.fuse`, the gateway's default fusion and
candidate depth), and the top ``k`` documents decoded from the bytes Redis stores
(:func:`~services.index.client.documents.stored`). CPU time per search
(``time.process_time``), in total and per stage.

**The stack**: ``gtr-retrieval up`` (Triton, 2 shards, no reranker) on the same
documents; ``--concurrency`` closed-loop callers send the same queries for ``--seconds``
per mode; the CPU every process of the stack used (``/proc``, :mod:`bench.cpu_roles`; the
load generator excluded) ÷ the searches answered. ``stack_over_floor`` per mode is that
÷ the floor's CPU per search of the same mode (goal for hybrid, the default: ≤ 1.6).

The machine's load average is recorded before and after: a figure taken beside other
work says so (``loaded``).

``--query-precision`` (fp32 by default, as the published figures): the floor's query
graph and the Triton stack's (``up --query-precision``); int8 measures both with the
int8 query tower, ``up``'s default since issue #34 (not run yet).

Usage: ``python -m bench.floor [--docs 1500] [--queries 300] [--seconds 20]
[--concurrency 4] [--encoders triton,inprocess] [--query-precision fp32|int8] [--no-stack]
[--out bench/results/floor.json]``; ``--encoders inprocess`` measures ``up --encoder
inprocess`` too (``stack_inprocess``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import cpu_roles

SHARED = Path(os.environ.get("GTR_DATA_DIR", Path(__file__).resolve().parents[2] / "shared/data"))
SCIFACT = SHARED / "scifact"
MODES = ("hybrid", "dense")
STAGES = ("encode", "dense", "sparse", "merge", "fusion", "fetch")


@dataclass
class Floor:
    """Everything a search touches, in this process."""

    embedder: Any  # OnnxEmbedder
    shards: list[Any]  # IvfPqShard
    store: dict[str, list[bytes | None]]  # doc id → the stored fields, as Redis holds them
    candidates: int
    fusion: Any  # Fusion

    def search(self, query: str, mode: str, k: int, cpu: dict[str, float]) -> list[Any]:
        """One search; each stage's CPU seconds added to ``cpu``."""
        from services.common.fusion import fuse
        from services.index.client.documents import STORED_FIELDS, stored

        clock = time.process_time
        t0 = clock()
        depth = max(k, self.candidates) if mode == "hybrid" else k
        dense: list[tuple[str, float]] = []
        sparse: list[tuple[str, float]] = []
        vector = self.embedder.embed([query], "query")[0][:1]
        t1 = clock()
        cpu["encode"] += t1 - t0
        dense_rows = [s.search_top_k(vector, depth).hits()[0] for s in self.shards]
        t2 = clock()
        cpu["dense"] += t2 - t1
        sparse_rows: list[list[tuple[str, float]]] = []
        if mode == "hybrid":
            for s in self.shards:
                sparse_rows.append(s.search_text(s.query_terms([query]), depth).hits()[0])
        t3 = clock()
        cpu["sparse"] += t3 - t2
        dense = _merge(dense_rows, depth)
        sparse = _merge(sparse_rows, depth)
        t4 = clock()
        cpu["merge"] += t4 - t3
        if mode == "hybrid":
            ids = [h.id for h in fuse(dense, sparse, self.fusion, k)]
        else:
            ids = [doc_id for doc_id, _ in dense[:k]]
        t5 = clock()
        cpu["fusion"] += t5 - t4
        empty = [None] * len(STORED_FIELDS)
        docs = [stored(i, self.store.get(i, empty)) for i in ids]
        cpu["fetch"] += clock() - t5
        return docs


def _merge(rows: list[list[tuple[str, float]]], k: int) -> list[tuple[str, float]]:
    """The shards' lists (each best first) into one top ``k``, as the router merges them."""
    merged = [hit for row in rows for hit in row]
    merged.sort(key=lambda hit: -hit[1])
    return merged[:k]


def build_floor(corpus: Path, workdir: Path, num_shards: int, precision: str = "fp32") -> Floor:
    """Export the default model (``precision`` "int8": with its int8 query tower, as
    ``up`` does), embed the corpus, train and fill one shard per part."""
    from threadpoolctl import threadpool_limits

    from services.common.fusion import RetrievalDefaults
    from services.corpus.readers import read_corpus
    from services.encoder.build.export import export_onnx
    from services.encoder.model import default_model_dir
    from services.encoder.runtime.onnx_embedder import OnnxEmbedder
    from services.index.core.changes import Upsert
    from services.index.core.ids import shard_of
    from services.index.core.shard import IvfPqShard
    from services.index.core.text import TextIndex
    from services.index.core.train import TrainOptions, train_index
    from services.index.core.trained import TrainedIndex

    onnx_path = workdir / "onnx" / "model.onnx"
    if precision == "int8":
        from services.encoder.build.query_int8 import export_with_int8_query

        export_with_int8_query(default_model_dir(), onnx_path, None)
    else:
        export_onnx(default_model_dir(), onnx_path)
    docs = list(read_corpus(corpus))
    bodies = [d.embedding_text for d in docs]
    print(f"floor: embedding {len(docs)} documents (setup, not measured)", flush=True)
    builder = OnnxEmbedder(onnx_path, threads=len(os.sched_getaffinity(0)))
    vectors = np.concatenate(
        [builder.embed(bodies[i : i + 64], "document")[0] for i in range(0, len(bodies), 64)]
    )
    parts: list[list[int]] = [[] for _ in range(num_shards)]
    for row, doc in enumerate(docs):
        parts[shard_of(doc.id, num_shards)].append(row)
    shards = []
    for n, rows in enumerate(parts):
        index_dir = workdir / f"shard-{n}" / "index"
        train_index(vectors[rows], index_dir, TrainOptions(model="floor"))
        shard = IvfPqShard(
            TrainedIndex.load(index_dir), TextIndex.create(index_dir.parent / "text")
        )
        shard.apply(
            [Upsert(docs[r].id, vectors[r], body=bodies[r]) for r in rows], f"1-{len(rows)}"
        )
        shards.append(shard)
    store: dict[str, list[bytes | None]] = {
        d.id: [d.title.encode(), d.text.encode(), json.dumps(d.metadata).encode(), b"1"]
        for d in docs
    }
    # single-threaded from here, as a shard runs (services/index/server/process.py): the
    # BLAS and OpenMP pools (a thread per CPU by default) spin after each call, and that
    # CPU doubled the process's time per search, on a thread doing nothing useful
    threadpool_limits(1)
    defaults = RetrievalDefaults()
    return Floor(
        OnnxEmbedder(onnx_path, threads=1), shards, store, defaults.candidates, defaults.fusion
    )


def _threads_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, by ``name/tid``."""
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        stat = cpu_roles.read_stat(f"/proc/self/task/{tid}/stat")
        if stat is not None:
            out[f"{stat[0]}/{tid}"] = stat[2]
    return out


def measure_floor(floor: Floor, queries: list[str], mode: str, k: int) -> dict[str, Any]:
    """CPU ms per search (and per stage) over ``queries``, after one warm-up pass."""
    cpu = dict.fromkeys(STAGES, 0.0)
    for q in queries[:20]:
        floor.search(q, mode, k, cpu)
    cpu = dict.fromkeys(STAGES, 0.0)
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    start_thread, threads = time.thread_time(), _threads_cpu()
    for q in queries:
        floor.search(q, mode, k, cpu)
    after = _threads_cpu()
    busy = {t: round(v - threads.get(t, 0.0), 3) for t, v in after.items()}
    total = time.process_time() - start_cpu
    thread = time.thread_time() - start_thread
    wall = time.perf_counter() - start_wall
    n = len(queries)
    return {
        "cpu_ms_per_search": 1e3 * total / n,
        # the calling thread's alone: equal to the above when nothing runs beside it
        "thread_cpu_ms_per_search": 1e3 * thread / n,
        "wall_ms_per_search": 1e3 * wall / n,
        "stages_cpu_ms": {s: round(1e3 * v / n, 3) for s, v in cpu.items()},
        "threads_cpu_s": {t: v for t, v in busy.items() if v > 0},
    }


async def _closed_loop(
    address: str,
    queries: list[str],
    mode: str,
    k: int,
    seconds: float,
    concurrency: int,
    credentials: Any = None,
    metadata: tuple[tuple[str, str], ...] = (),
) -> tuple[int, int]:
    """(searches answered, failed) by ``concurrency`` callers for ``seconds``; TLS with
    ``credentials`` (``grpc.ChannelCredentials``), ``metadata`` on every call (a token)."""
    import grpc

    from retrieval.v1 import search_pb2, search_pb2_grpc

    modes = {
        "hybrid": search_pb2.RETRIEVAL_MODE_HYBRID,
        "dense": search_pb2.RETRIEVAL_MODE_DENSE,
    }
    ok = failed = 0
    end = time.monotonic() + seconds
    channel_of = (
        grpc.aio.insecure_channel(address)
        if credentials is None
        else grpc.aio.secure_channel(address, credentials)
    )
    async with channel_of as channel:
        stub = search_pb2_grpc.SearchServiceStub(channel)

        async def caller(offset: int) -> None:
            nonlocal ok, failed
            i = offset
            while time.monotonic() < end:
                request = search_pb2.SearchRequest(
                    query=queries[i % len(queries)], k=k, mode=modes[mode]
                )
                try:
                    await stub.Search(request, timeout=5.0, metadata=metadata)
                    ok += 1
                except grpc.aio.AioRpcError:
                    failed += 1
                i += concurrency

        await asyncio.gather(*(caller(c) for c in range(concurrency)))
    return ok, failed


def measure_stack(
    stack_address: str,
    queries: list[str],
    mode: str,
    k: int,
    seconds: float,
    concurrency: int,
    credentials: Any = None,
    metadata: tuple[tuple[str, str], ...] = (),
) -> dict[str, Any]:
    """The stack's CPU per search of ``mode`` (every process but this one's); a stack
    with ``--tls``/``--auth`` takes ``credentials`` and the token's ``metadata``."""
    access = (credentials, metadata)
    asyncio.run(_closed_loop(stack_address, queries, mode, k, 3.0, concurrency, *access))
    root = os.getpid()
    before, t0 = cpu_roles.sample(root), time.monotonic()
    ok, failed = asyncio.run(
        _closed_loop(stack_address, queries, mode, k, seconds, concurrency, *access)
    )
    after, t1 = cpu_roles.sample(root), time.monotonic()
    roles = {
        key: max(0.0, after[key] - before.get(key, 0.0))
        for key in after
        if key != "client" and key not in cpu_roles.MACHINE_KEYS
    }
    stack_s = sum(roles.values())
    return {
        "searches": ok,
        "failed": failed,
        "searches_per_s": ok / (t1 - t0),
        "cpu_ms_per_search": 1e3 * stack_s / max(ok, 1),
        "roles_cpu_ms_per_search": {
            key: round(1e3 * v / max(ok, 1), 3) for key, v in sorted(roles.items())
        },
        "client_cpu_ms_per_search": 1e3
        * max(0.0, after.get("client", 0.0) - before.get("client", 0.0))
        / max(ok, 1),
    }


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--docs", type=int, default=1500, help="SciFact documents (1500)")
    parser.add_argument("--queries", type=int, default=300, help="queries measured (300)")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0, help="per mode through the stack")
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop callers (4)")
    parser.add_argument("--no-stack", action="store_true", help="the floor only")
    parser.add_argument(
        "--encoders",
        default="triton",
        help="the stack's query encoders measured, comma-separated: triton (the default "
        "stack's), inprocess (ONNX Runtime in the gateway: `up --encoder inprocess`)",
    )
    parser.add_argument(
        "--query-precision",
        choices=["fp32", "int8"],
        default="fp32",
        help="the query graph of the floor and of the Triton stack (default fp32)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/floor.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tests.support.local_stack import local_stack, queries, small_corpus

    load_before = _loadavg()
    texts = queries(SCIFACT, args.queries)
    result: dict[str, Any] = {
        "docs": args.docs,
        "queries": len(texts),
        "k": args.k,
        "query_precision": args.query_precision,
    }
    with tempfile.TemporaryDirectory(prefix="gtr-bench-floor-") as tmp_name:
        tmp = Path(tmp_name)
        corpus = tmp / "corpus.jsonl"
        small_corpus(SCIFACT, corpus, args.docs, text_chars=100_000)
        floor = build_floor(corpus, tmp / "floor", args.shards, args.query_precision)
        result["floor"] = {m: measure_floor(floor, texts, m, args.k) for m in MODES}
        for m in MODES:
            f = result["floor"][m]
            print(f"floor {m}: {f['cpu_ms_per_search']:.2f} ms CPU per search {f['stages_cpu_ms']}")
        del floor
        for encoder in [] if args.no_stack else args.encoders.split(","):
            key = "stack" if encoder == "triton" else f"stack_{encoder}"
            with local_stack(
                tmp / f"run-{encoder}",
                tmp / f"up-{encoder}.log",
                corpus=corpus,
                shards=args.shards,
                encoder=encoder,
                extra=["--query-precision", args.query_precision] if encoder == "triton" else [],
            ) as st:
                result[key] = {
                    m: measure_stack(st.gateway, texts, m, args.k, args.seconds, args.concurrency)
                    for m in MODES
                }
            for m in MODES:
                s, f = result[key][m], result["floor"][m]
                s["stack_over_floor"] = s["cpu_ms_per_search"] / f["cpu_ms_per_search"]
                print(
                    f"{key} {m}: {s['cpu_ms_per_search']:.2f} ms CPU per search "
                    f"({s['searches_per_s']:.0f}/s, {s['failed']} failed) = "
                    f"{s['stack_over_floor']:.2f}x the floor; by process "
                    f"{s['roles_cpu_ms_per_search']}"
                )
    result["loadavg_before"], result["loadavg_after"] = load_before, _loadavg()
    busy = max(result["loadavg_before"][0], result["loadavg_after"][0])
    result["loaded"] = busy > 0.5 * len(os.sched_getaffinity(0))
    if result["loaded"]:
        print(f"the machine was loaded (load average {busy}): figures are not a quiet run's")
    _write(args.out, result, lambda: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    return result


def _write(out: Path, result: dict[str, Any], now: Callable[[], str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {"source": {"bench": "floor", "run": now()}, **result}
    out.write_text(json.dumps(body, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
