"""What the query-embedding cache saves: a cache hit against encoding the query.

    .venv/bin/python -m bench.query_cache [--queries 200] [--batch 1,16] [--rounds 3]
        [--threads 1]

Starts a real redis-server as the tests run it (AOF, ``appendfsync always``, as the local
stack's Redis that the cache shares by default) and the real
all-MiniLM-L6-v2 encoder in this process (``--threads`` for PyTorch; Triton on a GPU is
faster than this, on a CPU it adds a gRPC hop to the same work). For each batch size it
takes the SciFact test queries (``../shared/data/scifact/queries.jsonl``, or numbered
synthetic queries when absent), and alternates, round by round, the two ways a gateway
gets their embeddings: ``Encoder.encode`` (what every search did before the cache) and
:meth:`QueryEmbeddingCache.lookup` of entries stored beforehand (a hit: one Lua script
round trip). Reports per call the p50/p99 of both and the ratio encode / hit, measured
in the same run; a miss costs the lookup plus the encode (printed too). Prints one JSON
line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _queries(n: int) -> list[str]:
    path = (
        Path(os.environ.get("GTR_DATA_DIR", ROOT.parent / "shared" / "data"))
        / "scifact"
        / "queries.jsonl"
    )
    if path.exists():
        lines = path.read_text().splitlines()
        texts = [json.loads(line)["text"] for line in lines if line.strip()]
        return texts[:n]
    return [f"synthetic query number {i} about reading csv files" for i in range(n)]


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values) * 1000.0, q))


async def _run(args: argparse.Namespace, url: str) -> dict[str, object]:
    from services.encoder.runtime.inprocess import InProcessEncoder
    from services.gateway.query_cache import QueryEmbeddingCache

    encoder = InProcessEncoder.torch(threads=args.threads)
    cache = QueryEmbeddingCache(
        url,
        model=encoder.model_name,
        size="minilm",
        dim=encoder.dim,
        ttl_s=3600,
        max_entries=100_000,
        timeout_s=1.0,
    )
    texts = _queries(args.queries)
    out: dict[str, object] = {"queries": len(texts), "model": encoder.model_name}
    try:
        for batch in args.batch:
            groups = [texts[i : i + batch] for i in range(0, len(texts) - batch + 1, batch)]
            for group in groups:  # fill the cache (and warm the model)
                got = await encoder.encode(group, "query")
                cache.store(cache.keys(group, "query"), got.vectors, got.truncated)
            await cache.drain()
            encode_s: list[float] = []
            hit_s: list[float] = []
            miss_lookup_s: list[float] = []
            for _ in range(args.rounds):
                for group in groups:
                    t = time.perf_counter()
                    await encoder.encode(group, "query")
                    encode_s.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    found = await cache.lookup(cache.keys(group, "query"))
                    hit_s.append(time.perf_counter() - t)
                    assert all(f is not None for f in found), "every entry was stored"
                    t = time.perf_counter()
                    await cache.lookup(cache.keys([f"never stored {x}" for x in group], "query"))
                    miss_lookup_s.append(time.perf_counter() - t)
            row = {
                "calls": len(encode_s),
                "encode_p50_ms": _pct(encode_s, 50),
                "encode_p99_ms": _pct(encode_s, 99),
                "hit_p50_ms": _pct(hit_s, 50),
                "hit_p99_ms": _pct(hit_s, 99),
                "miss_lookup_p50_ms": _pct(miss_lookup_s, 50),
            }
            row["encode_over_hit_p50"] = row["encode_p50_ms"] / row["hit_p50_ms"]
            out[f"batch_{batch}"] = row
            print(
                f"batch {batch:>3}: encode p50 {row['encode_p50_ms']:7.2f} ms "
                f"p99 {row['encode_p99_ms']:7.2f} | cache hit p50 {row['hit_p50_ms']:6.2f} ms "
                f"p99 {row['hit_p99_ms']:6.2f} | a miss adds {row['miss_lookup_p50_ms']:.2f} ms "
                f"| encode / hit = {row['encode_over_hit_p50']:.1f}x ({row['calls']} calls each)",
                flush=True,
            )
    finally:
        await cache.close()
        await encoder.close()
    return out


def main(argv: list[str] | None = None) -> int:
    from tests.support.processes import run_redis

    parser = argparse.ArgumentParser(prog="python -m bench.query_cache", description=__doc__)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-qcache-") as tmp, run_redis(Path(tmp)) as r:
        result = asyncio.run(_run(args, r.url))
    print(json.dumps({"bench": "query_cache", **result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
