"""What a shard's text commits cost its searches under a steady trickle of writes
(docs/index.md "The text index's refresh").

One shard in this process (half of SciFact: its documents' vectors and text, the index
trained with ``index train``'s defaults), as a shard server runs it: FAISS with one
OpenMP thread, searches on a pool of 2 threads. A writer thread upserts one document
per batch at ``--writes-per-s`` (the log consumer at a trickle: one entry per read);
searches arrive open-loop (Poisson, ``--searches-per-s``), each a dense top 100 and a
BM25 top 100 as a hybrid search's shard request, its latency counted from its scheduled
start. Three ways to make the writes searchable, alternated round by round in one run:

- ``locked``: a commit per batch, under the shard's write lock (the code before this
  change: every search waited for it);
- ``per_batch``: a commit per batch, outside the write lock (``apply(refresh=True)``);
- ``interval``: a refresh every ``--refresh-s`` (the log consumer's default,
  :class:`~services.index.server.refresh.Refresher`), outside the lock.

Prints per mode the search p50/p99/p99.9, the process's CPU (cores) and the commits per
second, and each as a ratio to ``locked`` (median over rounds; the JSON keeps every
round). Usage: ``python -m bench.text_refresh [--rounds 3] [--seconds 10]
[--writes-per-s 10] [--searches-per-s 50] [--refresh-s 0.25] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

SHARED = Path(os.environ.get("GTR_DATA_DIR", Path(__file__).resolve().parents[2] / "shared/data"))
SCIFACT = SHARED / "scifact"
MODES = ("locked", "per_batch", "interval")


def build_shard(workdir: Path, docs: int) -> tuple[Any, list[Any], np.ndarray, list[str]]:
    """(shard holding ``docs`` SciFact documents, upserts to write, query vectors, query
    texts)."""
    import faiss

    from services.index.core.changes import Upsert
    from services.index.core.shard import IvfPqShard
    from services.index.core.text import TextIndex
    from services.index.core.train import TrainOptions, train_index
    from services.index.core.trained import TrainedIndex

    faiss.omp_set_num_threads(1)
    vectors = np.load(SCIFACT / "corpus.all-MiniLM-L6-v2.npy")
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as fh:
        corpus = [json.loads(line) for line in fh]
    upserts = [
        Upsert(d["_id"], vectors[i], body=f"{d['title']} {d['text']}") for i, d in enumerate(corpus)
    ]
    train_index(vectors[:docs], workdir / "index", TrainOptions(model="bench"))
    shard = IvfPqShard(TrainedIndex.load(workdir / "index"), TextIndex.create(workdir / "text"))
    shard.apply(upserts[:docs], "1-0")
    with open(SCIFACT / "queries.jsonl", encoding="utf-8") as fh:
        queries = [json.loads(line)["text"] for line in fh]
    rng = np.random.default_rng(0)
    probes = vectors[rng.choice(len(vectors), 256, replace=False)]
    return shard, upserts[docs:], probes, queries


def commit_under_lock(shard: Any) -> None:
    """The code before: the batch's commit inside the write lock, searches held out."""
    with shard.writers(), shard.lock.write():
        shard.refresh_held()


def writer(
    shard: Any, mode: str, upserts: list[Any], rate: float, refresh_s: float, stop: threading.Event
) -> int:
    """Upsert one document per batch at ``rate`` until ``stop``; the commits made."""
    from services.index.server.refresh import Refresher

    refresher, commits, seq, i = Refresher(refresh_s), 0, int(time.time() * 1000), 0
    next_at = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_at:
            seq += 1
            shard.apply([upserts[i % len(upserts)]], f"{seq}-0", refresh=mode == "per_batch")
            i, next_at = i + 1, next_at + 1.0 / rate
            commits += mode == "per_batch"
            if mode == "locked":
                commit_under_lock(shard)
                commits += 1
            refresher.applied(int(time.time() * 1000))  # the entry's log time
        if mode == "interval" and refresher.due(shard):
            refresher.refresh(shard)
            commits += 1
        stop.wait(min(0.05, max(0.0, next_at - time.monotonic())))  # the consumer's 50 ms
    return commits


def searches(
    shard: Any, probes: np.ndarray, terms: list[list[str]], rate: float, seconds: float
) -> list[float]:
    """Open-loop Poisson searches on 2 threads; each one's latency (ms) from its
    scheduled start."""
    rng = np.random.default_rng(int(time.time()))
    latencies: list[float] = []
    lock = threading.Lock()

    def one(n: int, scheduled: float) -> None:
        shard.search_top_k(probes[n % len(probes)][None, :], 100)
        shard.search_text([terms[n % len(terms)]], 100)
        with lock:
            latencies.append((time.perf_counter() - scheduled) * 1000)

    with ThreadPoolExecutor(2) as pool:
        start = time.perf_counter()
        at, n = start, 0
        while at - start < seconds:
            at += rng.exponential(1.0 / rate)
            delay = at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, n, at)
            n += 1
    return latencies


def measure(
    shard: Any,
    mode: str,
    upserts: list[Any],
    probes: np.ndarray,
    terms: list[list[str]],
    args: argparse.Namespace,
) -> dict[str, float]:
    stop, result = threading.Event(), dict[str, int]()
    thread = threading.Thread(
        target=lambda: result.update(
            commits=writer(shard, mode, upserts, args.writes_per_s, args.refresh_s, stop)
        )
    )
    cpu0, wall0 = time.process_time(), time.perf_counter()
    thread.start()
    lat = searches(shard, probes, terms, args.searches_per_s, args.seconds)
    stop.set()
    thread.join()
    wall = time.perf_counter() - wall0
    shard.refresh()  # nothing left over for the next mode
    q = np.percentile(lat, [50, 99, 99.9])
    return {
        "p50_ms": round(float(q[0]), 3),
        "p99_ms": round(float(q[1]), 3),
        "p999_ms": round(float(q[2]), 3),
        "searches": len(lat),
        "cpu_cores": round((time.process_time() - cpu0) / wall, 4),
        "commits_per_s": round(result["commits"] / wall, 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=2600, help="documents in the shard (half)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=10.0, help="per mode and round")
    p.add_argument("--writes-per-s", type=float, default=10.0, help="1-document batches")
    p.add_argument("--searches-per-s", type=float, default=50.0)
    p.add_argument("--refresh-s", type=float, default=0.25)
    p.add_argument("--out", type=Path, default=Path("bench/results/text_refresh.json"))
    args = p.parse_args(argv)
    from threadpoolctl import threadpool_limits

    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp, threadpool_limits(1):
        shard, upserts, probes, queries = build_shard(Path(tmp), args.docs)
        terms = shard.query_terms(queries)
        rounds: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                rounds[mode].append(measure(shard, mode, upserts, probes, terms, args))
                print(f"round {r + 1} {mode}: {rounds[mode][-1]}", flush=True)
    median: Callable[[str, str], float] = lambda m, k: statistics.median(  # noqa: E731
        x[k] for x in rounds[m]
    )
    figures = ("p50_ms", "p99_ms", "p999_ms", "cpu_cores", "commits_per_s")
    summary = {m: {k: median(m, k) for k in figures} for m in MODES}
    ratios = {
        m: {k: round(summary[m][k] / summary["locked"][k], 3) for k in figures[:4]}
        for m in MODES[1:]
    }
    result = {
        "source": {
            "bench": "bench.text_refresh",
            "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "loadavg_before": load_before,
        "loadavg_after": list(os.getloadavg()),
        "median": summary,
        "over_locked": ratios,
        "rounds": rounds,
    }
    print(json.dumps({"median": summary, "over_locked": ratios}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
