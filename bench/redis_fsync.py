"""What ``appendfsync always`` costs the upsert path, against ``everysec``.

    .venv/bin/python -m bench.redis_fsync [--seconds 3] [--rounds 2] [--batches 1,32]
        [--concurrency 1,16] [--dir DIR]

Starts two real redis-server processes with the local stack's own command line
(``services.stack.components.redis_child``: AOF on, RDB off), one with
``--appendfsync always`` (the stack's default: an acknowledged upsert is on disk) and
one with ``everysec`` (the last second of writes can be lost on a power loss or kernel
crash). Then, for every batch size and concurrency, it drives the project's real write
path, :meth:`ChangeLogWriter.upsert` (one Lua script: HSET of each document and XADD
to its shard's log, 2 shards), with random unit vectors of dimension 384 and ~600
characters of text per document, alternating the two servers round by round so that
both see the same machine. Per cell it reports upserts/s, documents/s and the latency
percentiles of one upsert call, then the ratio always / everysec. The data directories
default to a temporary folder in the stack's default run directory ``.run/``, so on the
filesystem the stack writes its AOF to (fsync on a tmpfs would cost nothing). Prints
one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DIM = 384
SHARDS = 2
POLICIES = ("always", "everysec")


def _records(rng: np.random.Generator, n: int, prefix: str) -> list[Any]:
    from services.index.client.writer import DocRecord

    vectors = rng.standard_normal((n, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    text = "lorem ipsum dolor sit amet consectetur " * 15  # ~600 characters
    return [
        DocRecord(f"{prefix}-{i}", vectors[i], title=f"doc {prefix}-{i}", text=text,
                  metadata={"source": "bench"})
        for i in range(n)
    ]  # fmt: skip


async def _round(url: str, batch: int, concurrency: int, seconds: float, seed: int) -> list[float]:
    """Upsert for ``seconds`` with ``concurrency`` writers; each call's latency (s)."""
    from services.index.client.writer import ChangeLogWriter

    writer = ChangeLogWriter(url, SHARDS, dim=DIM)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="Per round and cell.")
    parser.add_argument("--rounds", type=int, default=2, help="Rounds per server and cell.")
    parser.add_argument("--batches", default="1,32", help="Documents per upsert call.")
    parser.add_argument("--concurrency", default="1,16", help="Concurrent upsert calls.")
    parser.add_argument("--dir", type=Path, default=None, help="Where the AOF files go.")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    from services.stack import components
    from services.stack.children import Child
    from services.stack.config import StackConfig

    parent = args.dir or ROOT / ".run"
    parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="bench-redis-fsync-", dir=parent))
    servers: dict[str, Child] = {}
    try:
        for policy in POLICIES:
            cfg = StackConfig(run_dir=base / policy, redis_fsync=policy)  # type: ignore[arg-type]
            child = components.redis_child(cfg)
            child.start()
            child.wait_ready(lambda c=child: components.redis_ready(c), 30)  # type: ignore[misc]
            servers[policy] = child
        results: dict[str, dict[str, Any]] = {p: {} for p in POLICIES}
        seed = 0
        for batch in batches:
            for concurrency in concurrencies:
                cell = f"batch={batch},concurrency={concurrency}"
                lat: dict[str, list[float]] = {p: [] for p in POLICIES}
                for _ in range(args.rounds):
                    for policy in POLICIES:  # alternate: both see the same machine
                        seed += 1
                        lat[policy] += asyncio.run(
                            _round(servers[policy].address, batch, concurrency, args.seconds, seed)
                        )
                for policy in POLICIES:
                    results[policy][cell] = _summary(lat[policy], args.seconds * args.rounds, batch)
                a, e = results["always"][cell], results["everysec"][cell]
                print(
                    f"{cell:<26} always {a['docs_per_s']:>9.0f} docs/s p50 {a['p50_ms']:.2f} ms "
                    f"p99 {a['p99_ms']:.2f} ms | everysec {e['docs_per_s']:>9.0f} docs/s "
                    f"p50 {e['p50_ms']:.2f} ms p99 {e['p99_ms']:.2f} ms | "
                    f"throughput ratio {a['docs_per_s'] / e['docs_per_s']:.2f}",
                    flush=True,
                )
        ratio = {
            cell: round(a["docs_per_s"] / results["everysec"][cell]["docs_per_s"], 3)
            for cell, a in results["always"].items()
        }
        print(json.dumps({
            "bench": "redis_fsync", "dim": DIM, "shards": SHARDS, "seconds": args.seconds,
            "rounds": args.rounds, "filesystem_dir": str(base), "results": results,
            "throughput_ratio_always_over_everysec": ratio,
        }))  # fmt: skip
        return 0
    finally:
        for child in servers.values():
            child.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
