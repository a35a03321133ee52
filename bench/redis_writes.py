"""The measuring loop the Redis write benches share (``bench.redis_fsync``,
``bench.redis_wait``): the project's real write path, :meth:`ChangeLogWriter.upsert`
(one Lua script per call: HSET per document + XADD to its shard's log, 2 shards), with
random 384-d unit vectors and ~600 characters of text per document, driven against two
setups ("sides") alternating round by round so that both see the same machine. Per
batch size and concurrency ("cell"): upserts/s, documents/s and the latency percentiles
of one upsert call for each side, then the ratio of the first side's documents/s over
the second's.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DIM = 384
SHARDS = 2


@dataclass(frozen=True)
class Side:
    """One of the two setups compared: a label for the per-cell line, the Redis URL to
    write to, and the writer's ``wait_replicas`` (WAIT for that many replicas)."""

    label: str
    url: str
    wait_replicas: int = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags both benches take."""
    parser.add_argument("--seconds", type=float, default=3.0, help="Per round and cell.")
    parser.add_argument("--rounds", type=int, default=2, help="Rounds per side and cell.")
    parser.add_argument("--batches", default="1,32", help="Documents per upsert call.")
    parser.add_argument("--concurrency", default="1,16", help="Concurrent upsert calls.")
    parser.add_argument("--dir", type=Path, default=None, help="Where the AOF files go.")


def work_dir(parent: Path | None, prefix: str) -> Path:
    """A fresh folder for the servers' data, by default in the stack's run directory
    ``.run/`` (the filesystem the stack writes its AOF to: fsync on a tmpfs costs
    nothing)."""
    parent = parent or ROOT / ".run"
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def _records(rng: np.random.Generator, n: int, prefix: str) -> list[Any]:
    from services.index.client.writer import DocRecord

    vectors = rng.standard_normal((n, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    text = "lorem ipsum dolor sit amet consectetur " * 15  # ~600 characters
    return [
        DocRecord(
            f"{prefix}-{i}",
            vectors[i],
            title=f"doc {prefix}-{i}",
            text=text,
            metadata={"source": "bench"},
        )
        for i in range(n)
    ]


async def _round(
    side: Side, batch: int, concurrency: int, seconds: float, seed: int
) -> list[float]:
    """Upsert for ``seconds`` with ``concurrency`` writers; each call's latency (s)."""
    from services.index.client.writer import ChangeLogWriter

    writer = ChangeLogWriter.connect(
        side.url, SHARDS, dim=DIM, wait_replicas=side.wait_replicas, wait_timeout_ms=5000
    )
    rng = np.random.default_rng(seed)
    pool = [_records(rng, batch, f"s{seed}-p{p}") for p in range(8)]
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def one(worker: int) -> None:
        n = 0
        while time.perf_counter() < deadline:
            records = pool[(worker + n) % len(pool)]
            start = time.perf_counter()
            await writer.upsert(records)
            latencies.append(time.perf_counter() - start)
            n += 1

    try:
        await writer.upsert(pool[0])  # connect and load the script outside the clock
        await asyncio.gather(*[one(w) for w in range(concurrency)])
    finally:
        await writer.close()
    return latencies


def _summary(latencies: list[float], seconds: float, batch: int) -> dict[str, float]:
    ms = np.asarray(latencies) * 1e3
    calls = len(latencies) / seconds
    return {
        "upserts_per_s": round(calls, 1),
        "docs_per_s": round(calls * batch, 1),
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "mean_ms": round(float(ms.mean()), 3),
    }


def compare(
    sides: dict[str, Side], args: argparse.Namespace
) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """Every cell of ``args.batches`` x ``args.concurrency``, ``args.rounds`` rounds of
    ``args.seconds`` per side, alternating the sides; prints one line per cell. Returns
    the per-side results by cell and the throughput ratio (first side over second) by
    cell. ``sides`` holds exactly two entries, keyed by their name in the JSON."""
    (first, a_side), (second, b_side) = sides.items()
    batches = [int(b) for b in args.batches.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, dict[str, Any]] = {name: {} for name in sides}
    seed = 0
    for batch in batches:
        for concurrency in concurrencies:
            cell = f"batch={batch},concurrency={concurrency}"
            lat: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(args.rounds):
                for name, side in sides.items():  # alternate: both see the same machine
                    seed += 1
                    lat[name] += asyncio.run(_round(side, batch, concurrency, args.seconds, seed))
            for name in sides:
                results[name][cell] = _summary(lat[name], args.seconds * args.rounds, batch)
            a, b = results[first][cell], results[second][cell]
            print(
                f"{cell:<26} {a_side.label} {a['docs_per_s']:>9.0f} docs/s "
                f"p50 {a['p50_ms']:.2f} ms p99 {a['p99_ms']:.2f} ms | "
                f"{b_side.label} {b['docs_per_s']:>9.0f} docs/s "
                f"p50 {b['p50_ms']:.2f} ms p99 {b['p99_ms']:.2f} ms | "
                f"throughput ratio {a['docs_per_s'] / b['docs_per_s']:.2f}",
                flush=True,
            )
    ratio = {
        cell: round(a["docs_per_s"] / results[second][cell]["docs_per_s"], 3)
        for cell, a in results[first].items()
    }
    return results, ratio
