"""Replicas bench: how a shard's replicas share the load, what killing one costs, and
what seeding a new replica from a peer costs against replaying the log.

Real processes on one machine: a Redis server, ``--shards`` shards × 2 replica processes
(each shard's replicas on 127.0.0.2 and 127.0.0.3 with one port) and a real DNS server
resolving each shard's name to its replicas; the router is given only the names
(``dns://…/shard-N.bench:port``), as the chart gives the gateway. Vectors: the SciFact
document embeddings, repeated with noise up to ``--vectors``. Printed last, one JSON line:

* ``min_replica_share``: of the queries a shard's replicas answered under
  ``--concurrency`` concurrent searches (counted by the replicas, ``ShardStats.searches``),
  the share of the less used one, lowest over the shards (0.5 = even);
  ``baseline_min_share``: the same load through the former router, which gave a
  ``dns:`` target to one gRPC channel (gRPC's resolver, pick_first policy);
  ``min_replica_missed`` / ``baseline_min_missed``: searches of each run that failed or
  came back partial;
* ``failed_during_kill`` / ``partial_during_kill``: searches that failed / came back
  without a shard while one replica of shard 0 was SIGKILLed under load (first attempt);
  ``failed_after_retry``: those still failing or partial when retried once;
* ``seed_s_per_million_vectors``: a new replica of shard 0 started after its log was
  trimmed, from spawn to SERVING (fetching the peer's snapshot, loading it, replaying
  the rest), per million vectors of the shard; ``replay_s_per_million_vectors``: a new
  replica started while the whole log was still there (replaying every entry), measured
  in the same run; ``seed_vs_replay`` = their ratio (both include the process start).

Usage: ``python -m bench.replicas [--vectors 60000] [--searches 3000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import redis

from retrieval.v1 import index_pb2, index_pb2_grpc
from services.common import positions
from services.common.domain import IndexResult
from services.index.changelog import LogReader
from services.index.client.replicas import Replica
from services.index.client.router import ShardRouter
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.train import TrainOptions, train_index
from tests.support.dns import run_dns
from tests.support.processes import free_port, run_redis
from tests.support.search_load import missed, search_load, searches_answered, shard_stats
from tests.support.shards import ShardCluster, start_shard

SCIFACT = Path(__file__).resolve().parents[2] / "shared" / "data" / "scifact"
HOSTS = ("127.0.0.2", "127.0.0.3")


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def corpus(n: int, seed: int = 0) -> np.ndarray:
    base = np.load(SCIFACT / "corpus.all-MiniLM-L6-v2.npy").astype(np.float32)
    rng = np.random.default_rng(seed)
    picks = base[rng.integers(0, len(base), n)]
    noisy = picks + rng.normal(0, 0.03, picks.shape).astype(np.float32)
    exact = min(n, len(base))
    noisy[:exact] = base[:exact]
    return (noisy / np.linalg.norm(noisy, axis=1, keepdims=True)).astype(np.float32)


def shares(cluster: ShardCluster, before: dict[str, int]) -> float:
    lowest = 1.0
    for procs in cluster.processes:
        answered = [int(shard_stats(p).searches) - before[p.address] for p in procs]
        lowest = min(lowest, min(answered) / max(1, sum(answered)))
    return lowest


def counts(cluster: ShardCluster) -> dict[str, int]:
    return searches_answered(p for p in cluster.all() if p.alive)


def balance(
    cluster: ShardCluster, targets: list[list[str]], queries: np.ndarray, concurrency: int
) -> dict[str, object]:
    out: dict[str, object] = {}
    for former, key in ((False, "min_replica_share"), (True, "baseline_min_share")):
        before = counts(cluster)

        async def run(former: bool = former) -> list[IndexResult | BaseException]:
            router = ShardRouter(targets)
            if former:  # one channel per shard to its dns: target: gRPC's resolver, pick_first
                for s in router._shards:  # (bench only: the former wiring)
                    pool = s.replicas.pool
                    assert pool.target is not None
                    rs = s.replicas
                    pool.endpoints = [Replica(rs.shard, str(pool.target), rs.policy)]
                    pool.target = None
            try:
                return await search_load(router, queries, concurrency)
            finally:
                await router.close()

        results = asyncio.run(run())
        out[key] = round(shares(cluster, before), 3)
        out[key.replace("share", "missed")] = sum(missed(r) for r in results)
        say(f"  {key}: {out[key]}")
    return out


def kill_one(
    cluster: ShardCluster, targets: list[list[str]], queries: np.ndarray, concurrency: int
) -> dict[str, object]:
    victim = cluster.replica(0, 0)

    async def run() -> tuple[int, int, int]:
        router = ShardRouter(targets)

        def kill(done: int) -> None:
            if done == len(queries) // 4:
                victim.kill()

        try:
            first = await search_load(router, queries, concurrency, on_done=kill)
            again = [i for i, r in enumerate(first) if missed(r)]
            retried = await search_load(router, queries[again], concurrency) if again else []
        finally:
            await router.close()
        failed = sum(isinstance(r, BaseException) for r in first)
        partial = sum(isinstance(r, IndexResult) and bool(r.missing_shards) for r in first)
        return failed, partial, sum(missed(r) for r in retried)

    failed, partial, after = asyncio.run(run())
    say(f"  failed {failed}, partial {partial}, after one retry {after}")
    victim.restart(600)
    return {
        "failed_during_kill": failed,
        "partial_during_kill": partial,
        "failed_after_retry": after,
    }


def seed(cluster: ShardCluster, tmp: Path, redis_url: str, shards: int) -> dict[str, object]:
    in_shard = int(shard_stats(cluster.replica(0, 1)).vectors)
    peers = ",".join(p.address for p in cluster.processes[0])
    common = {
        "index_dir": tmp / "index",
        "redis_url": redis_url,
        "shard": 0,
        "shards": shards,
        "work_dir": tmp,
        "wait": False,
    }
    say(f"seed: shard 0 holds {in_shard} vectors; a new replica replays the whole log")
    started = time.perf_counter()
    replay = start_shard(replica="s0-replay", **common)  # type: ignore[arg-type]
    replay.wait_serving(1200)
    replay_s = time.perf_counter() - started
    replay.stop()  # leaves a snapshot: its registered floor is recent
    for proc in cluster.processes[0]:  # then every registered floor is: the log is trimmed
        with grpc.insecure_channel(proc.address) as channel:
            index_pb2_grpc.IndexShardServiceStub(channel).Snapshot(
                index_pb2.SnapshotRequest(), timeout=600
            )
    if not LogReader(redis.Redis.from_url(redis_url), 0).trimmed_past(positions.ZERO):
        raise RuntimeError("the log of shard 0 was not trimmed")
    say("  the log is trimmed; a new replica seeds itself from its peers")
    started = time.perf_counter()
    seeded = start_shard(replica="s0-seeded", settings={"peers": peers}, **common)  # type: ignore[arg-type]
    try:
        seeded.wait_serving(1200)
        seed_s = time.perf_counter() - started
    finally:
        seeded.stop()
    say(f"  seeded in {seed_s:.1f} s, replayed in {replay_s:.1f} s")
    million = max(in_shard, 1) / 1e6
    return {
        "shard_vectors": in_shard,
        "seed_s_per_million_vectors": round(seed_s / million, 1),
        "replay_s_per_million_vectors": round(replay_s / million, 1),
        "seed_vs_replay": round(seed_s / replay_s, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--vectors", type=int, default=60_000)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--searches", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    vectors = corpus(args.vectors)
    result: dict[str, object] = {"vectors": args.vectors, "shards": args.shards}
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp_name:
        tmp = Path(tmp_name)
        say(f"training IVF-PQ on {min(len(vectors), 20_000)} of {len(vectors)} vectors")
        train_index(vectors[:20_000], tmp / "index", TrainOptions(model="all-MiniLM-L6-v2"))
        with run_redis(tmp / "redis") as store, run_dns() as dns:
            asyncio.run(ingest(store.url, vectors, args.shards))
            ports = [free_port() for _ in range(args.shards)]
            cluster = ShardCluster([[] for _ in range(args.shards)])
            try:
                for shard, port in enumerate(ports):
                    dns.set(f"shard-{shard}.bench", list(HOSTS))
                    for r, host in enumerate(HOSTS):
                        proc = start_shard(
                            index_dir=tmp / "index",
                            redis_url=store.url,
                            shard=shard,
                            shards=args.shards,
                            work_dir=tmp,
                            replica=f"s{shard}-r{r}",
                            port=port,
                            host=host,
                            wait=False,
                        )
                        cluster.processes[shard].append(proc)
                for proc in cluster.all():
                    proc.wait_serving(600)
                targets = [[dns.target(f"shard-{s}.bench", p)] for s, p in enumerate(ports)]
                queries = vectors[np.random.default_rng(1).integers(0, len(vectors), args.searches)]
                say("balance: through the names, then through the former router (baseline)")
                result.update(balance(cluster, targets, queries, args.concurrency))
                say("kill: SIGKILL one replica of shard 0 under load")
                result.update(kill_one(cluster, targets, queries, args.concurrency))
                result.update(seed(cluster, tmp, store.url, args.shards))
            finally:
                cluster.stop()
    print(json.dumps(result))
    return 0


async def ingest(url: str, vectors: np.ndarray, shards: int) -> None:
    writer = ChangeLogWriter.connect(url, num_shards=shards, dim=vectors.shape[1])
    try:
        for i in range(0, len(vectors), 256):
            end = min(i + 256, len(vectors))
            await writer.upsert([DocRecord(f"v{j}", vectors[j]) for j in range(i, end)])
    finally:
        await writer.close()


if __name__ == "__main__":
    sys.exit(main())
