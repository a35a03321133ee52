"""What ``--redis-wait-replicas 1`` (WAIT for one replica after each write) costs the
upsert path, against acknowledging as soon as the primary has the write.

    .venv/bin/python -m bench.redis_wait [--seconds 3] [--rounds 2] [--batches 1,32]
        [--concurrency 1,16] [--dir DIR]

Starts a real redis-server with the local stack's own command line
(``services.stack.components.redis_child``: AOF on, ``appendfsync always``) and a second
one replicating it (``--replicaof``, same AOF policy), as a primary and its replica run
in production (there on two machines; here both share the same two cores and disk, so a
network round trip is not in the figure, only the replica's own work). Then, for every
batch size and concurrency, it drives the project's real write path,
:meth:`ChangeLogWriter.upsert` (one Lua script per call: HSET per document + XADD to
its shard's log, 2 shards), once with ``wait_replicas=0`` and once with
``wait_replicas=1`` (EVALSHA + WAIT 1 on the same connection, one round trip), with
random 384-d unit vectors and ~600 characters of text per document, alternating the two
round by round so that both see the same machine. Per cell: upserts/s, documents/s and
the latency percentiles of one upsert call, then the ratio wait ÷ no wait. The data
directories default to a temporary folder in ``.run/`` (the disk the stack writes its
AOF to). Prints one JSON line last.
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
MODES = {"no_wait": 0, "wait_1": 1}


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


async def _round(
    url: str, wait: int, batch: int, concurrency: int, seconds: float, seed: int
) -> list[float]:
    """Upsert for ``seconds`` with ``concurrency`` writers; each call's latency (s)."""
    from services.index.client.writer import ChangeLogWriter

    writer = ChangeLogWriter(url, SHARDS, dim=DIM, wait_replicas=wait, wait_timeout_ms=5000)
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
    parser.add_argument("--rounds", type=int, default=2, help="Rounds per mode and cell.")
    parser.add_argument("--batches", default="1,32", help="Documents per upsert call.")
    parser.add_argument("--concurrency", default="1,16", help="Concurrent upsert calls.")
    parser.add_argument("--dir", type=Path, default=None, help="Where the AOF files go.")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    import redis

    from services.stack import components
    from services.stack.children import Child
    from services.stack.config import StackConfig

    parent = args.dir or ROOT / ".run"
    parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="bench-redis-wait-", dir=parent))
    children: list[Child] = []
    try:
        primary = components.redis_child(StackConfig(run_dir=base / "primary"))
        primary.start()
        children.append(primary)
        primary.wait_ready(lambda: components.redis_ready(primary), 30)
        host, port = primary.address.split("//")[1].split("/")[0].split(":")
        replica = components.redis_child(StackConfig(run_dir=base / "replica"))
        replica.argv = [*replica.argv, "--replicaof", host, port]
        replica.start()
        children.append(replica)
        replica.wait_ready(lambda: components.redis_ready(replica), 30)
        link = redis.Redis.from_url(replica.address)
        deadline = time.monotonic() + 30
        while link.info("replication").get("master_link_status") != "up":
            if time.monotonic() > deadline:
                raise SystemExit("the replica did not sync with the primary in 30 s")
            time.sleep(0.05)
        link.close()

        results: dict[str, dict[str, Any]] = {m: {} for m in MODES}
        seed = 0
        for batch in batches:
            for concurrency in concurrencies:
                cell = f"batch={batch},concurrency={concurrency}"
                lat: dict[str, list[float]] = {m: [] for m in MODES}
                for _ in range(args.rounds):
                    for mode, wait in MODES.items():  # alternate: both see the same machine
                        seed += 1
                        lat[mode] += asyncio.run(
                            _round(primary.address, wait, batch, concurrency, args.seconds, seed)
                        )
                for mode in MODES:
                    results[mode][cell] = _summary(lat[mode], args.seconds * args.rounds, batch)
                w, n = results["wait_1"][cell], results["no_wait"][cell]
                print(
                    f"{cell:<26} WAIT 1 {w['docs_per_s']:>9.0f} docs/s p50 {w['p50_ms']:.2f} ms "
                    f"p99 {w['p99_ms']:.2f} ms | no WAIT {n['docs_per_s']:>9.0f} docs/s "
                    f"p50 {n['p50_ms']:.2f} ms p99 {n['p99_ms']:.2f} ms | "
                    f"throughput ratio {w['docs_per_s'] / n['docs_per_s']:.2f}",
                    flush=True,
                )
        ratio = {
            cell: round(w["docs_per_s"] / results["no_wait"][cell]["docs_per_s"], 3)
            for cell, w in results["wait_1"].items()
        }
        print(json.dumps({
            "bench": "redis_wait", "dim": DIM, "shards": SHARDS, "seconds": args.seconds,
            "rounds": args.rounds, "appendfsync": "always", "results": results,
            "throughput_ratio_wait_1_over_no_wait": ratio,
        }))  # fmt: skip
        return 0
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
