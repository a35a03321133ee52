"""Crashes, outages and the log's life cycle, with real shard processes and Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from retrieval.v1 import index_pb2, index_pb2_grpc
from services.common.domain import IndexResult
from services.common.errors import DeadlineExceeded, Unavailable
from services.common.positions import WriteToken, merge_tokens
from services.index.client.router import ShardRouter
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.query import Consistency, IndexQuery
from services.index.core.snapshots import list_snapshots
from services.index.keys import log_key, snapshot_positions_key
from services.process.redis_client import sync_client
from tests.support.shards import run_shards, scifact_vectors, shared_test_index

SHARDS = 2
SNAP_0 = snapshot_positions_key(0)


@pytest.fixture(scope="module")
def vectors(scifact_dir: Path) -> np.ndarray:
    return scifact_vectors(scifact_dir)


@pytest.fixture(scope="module")
def index_dir(vectors: np.ndarray, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_test_index(tmp_path_factory.getbasetemp(), vectors)


def snapshot(address: str) -> index_pb2.SnapshotResponse:
    with grpc.insecure_channel(address) as channel:
        reply: index_pb2.SnapshotResponse = index_pb2_grpc.IndexShardServiceStub(channel).Snapshot(
            index_pb2.SnapshotRequest(), timeout=60
        )
        return reply


async def present(
    router: ShardRouter, ids: list[str], vector: np.ndarray, token: WriteToken
) -> set[str]:
    """Which of ``ids`` the index holds: a filtered search on their unique tags, probing
    every inverted list (a filter only narrows the lists that are probed)."""
    nlist = max(s.nlist for r in await router.stats() for s in r if s is not None)
    found: set[str] = set()
    for i in range(0, len(ids), 1000):
        chunk = ids[i : i + 1000]
        query = IndexQuery(
            vector[None],
            1000,
            nprobe=nlist,
            filter=[("uid", chunk)],
            consistency=Consistency.SESSION,
            write_token=token,
            require_complete=True,
        )
        result = await router.search(query, timeout=20)
        found |= {h.id for h in result.hits[0]}
    return found


def wait_applied(address: str, token: WriteToken, vector: np.ndarray) -> None:
    """Return once the replica at ``address`` has applied the log up to ``token``: a
    SESSION search there waits for it (instead of sleeping and hoping it has)."""

    async def go() -> None:
        router = ShardRouter([[address]])
        try:
            query = IndexQuery(
                vector[None],
                1,
                consistency=Consistency.SESSION,
                write_token=token,
                require_complete=True,
            )
            await router.search(query, timeout=30)
        finally:
            await router.close()

    asyncio.run(go())


@pytest.mark.slow
def test_kill_9_during_upserts_loses_no_acknowledged_write(
    index_dir: Path, any_redis_url: str, vectors: np.ndarray, tmp_path: Path
) -> None:
    settings = {"snapshot-every-entries": "300", "keep-snapshots": "2"}
    with run_shards(
        index_dir, any_redis_url, tmp_path, shards=SHARDS, settings=settings
    ) as cluster:
        victim = cluster.replica(0)

        async def run() -> None:
            writer = ChangeLogWriter.connect(any_redis_url, SHARDS, dim=384)
            router = ShardRouter(cluster.addresses)
            acked: set[str] = set()
            deleted: set[str] = set()
            token: WriteToken = {}
            try:
                start = time.monotonic()
                batch = 0
                killed = restarted = False
                while time.monotonic() - start < 6.0:
                    ids = [f"b{batch}-{j}" for j in range(25)]
                    records = [
                        DocRecord(d, vectors[(batch * 25 + j) % len(vectors)], metadata={"uid": d})
                        for j, d in enumerate(ids)
                    ]
                    token = merge_tokens(token, await writer.upsert(records))
                    acked.update(ids)
                    if batch % 3 == 2:  # delete some of an earlier batch
                        gone = [f"b{batch - 2}-{j}" for j in range(0, 25, 4)]
                        t, d, _ = await writer.delete(gone)
                        token = merge_tokens(token, t)
                        deleted.update(d)
                    batch += 1
                    if not killed and time.monotonic() - start > 2.0:
                        victim.kill()  # upserts keep streaming into its log meanwhile
                        killed = True
                    if killed and not restarted and time.monotonic() - start > 3.5:
                        await asyncio.get_running_loop().run_in_executor(None, victim.launch)
                        restarted = True
                    await asyncio.sleep(0.01)
                assert killed and restarted
                assert list_snapshots(victim.snapshot_dir), "snapshots were written before the kill"
                expected = acked - deleted
                found = await present(router, sorted(acked), vectors[0], token)
                assert found == expected
                total = sum(s.vectors for r in await router.stats() for s in r if s is not None)
                assert total == len(expected)
            finally:
                await writer.close()
                await router.close()

        asyncio.run(run())


def test_corrupt_snapshot_restarts_from_the_previous_one(
    index_dir: Path, redis_url: str, vectors: np.ndarray, tmp_path: Path
) -> None:
    with run_shards(index_dir, redis_url, tmp_path, shards=1) as cluster:
        shard = cluster.replica(0)

        async def write(lo: int, hi: int) -> WriteToken:
            writer = ChangeLogWriter.connect(redis_url, 1, dim=384)
            try:
                return await writer.upsert(
                    [DocRecord(str(i), vectors[i], metadata={"uid": str(i)}) for i in range(lo, hi)]
                )
            finally:
                await writer.close()

        asyncio.run(write(0, 100))
        first = snapshot(shard.address)
        asyncio.run(write(100, 200))
        second = snapshot(shard.address)
        token = asyncio.run(write(200, 300))
        shard.kill()
        newest = Path(second.path)
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
        shard.launch()
        assert "checksum mismatch" in shard.log_tail(200)

        async def check() -> None:
            router = ShardRouter(cluster.addresses)
            try:
                ids = [str(i) for i in range(300)]
                assert await present(router, ids, vectors[0], token) == set(ids)
                (stats,) = (await router.stats())[0]
                assert stats is not None and stats.vectors == 300
            finally:
                await router.close()

        asyncio.run(check())
        assert first.position < second.position


@pytest.mark.slow
def test_log_is_trimmed_only_below_the_slowest_replica(
    index_dir: Path, any_redis_url: str, vectors: np.ndarray, tmp_path: Path
) -> None:
    with run_shards(
        index_dir, any_redis_url, tmp_path, shards=1, replicas=2, settings={"keep-snapshots": "1"}
    ) as cluster:
        fast, slow = cluster.replica(0, 0), cluster.replica(0, 1)
        client: Any = sync_client(any_redis_url)

        async def write(lo: int, hi: int) -> WriteToken:
            writer = ChangeLogWriter.connect(any_redis_url, 1, dim=384)
            try:
                token: WriteToken = {}
                for i in range(lo, hi, 10):
                    token = await writer.upsert(
                        [DocRecord(str(j), vectors[j]) for j in range(i, i + 10)]
                    )
                return token
            finally:
                await writer.close()

        token = asyncio.run(write(0, 200))  # 20 entries
        wait_applied(fast.address, token, vectors[0])
        snapshot(fast.address)
        assert client.xlen(log_key(0)) == 20  # the slow replica has no snapshot yet
        positions = {k.decode(): v.decode() for k, v in client.hgetall(SNAP_0).items()}
        assert positions[slow.replica] == "0-0"

        snapshot(slow.address)  # now both have one: trimmed below the older of the two
        first_kept = client.xrange(log_key(0), count=1)[0][0].decode()
        floor = min(client.hvals(SNAP_0), key=lambda p: tuple(map(int, p.split(b"-"))))
        assert first_kept == floor.decode()
        token = asyncio.run(write(200, 300))
        wait_applied(slow.address, token, vectors[0])
        snapshot(slow.address)
        # the fast replica's snapshot is older now: nothing past it is trimmed
        assert client.xrange(log_key(0), count=1)[0][0] == client.hget(SNAP_0, fast.replica)

        # a brand-new replica could not replay a trimmed log: it refuses to start
        stranger = tmp_path / "stranger"
        from tests.support.shards import start_shard

        with pytest.raises(RuntimeError, match="trimmed"):
            start_shard(
                index_dir=index_dir,
                redis_url=any_redis_url,
                shard=0,
                shards=1,
                work_dir=stranger,
                replica="stranger",
                timeout=30,
            )


@pytest.mark.slow
def test_shard_down_gives_partial_results_within_the_deadline(
    index_dir: Path, redis_url: str, vectors: np.ndarray, tmp_path: Path
) -> None:
    with run_shards(index_dir, redis_url, tmp_path, shards=SHARDS) as cluster:

        async def write() -> None:
            writer = ChangeLogWriter.connect(redis_url, SHARDS, dim=384)
            try:
                await writer.upsert([DocRecord(str(i), vectors[i]) for i in range(400)])
            finally:
                await writer.close()

        asyncio.run(write())

        # The complete answer may wait for the 400 upserts to be applied (a slow machine
        # must not turn it partial); the partial ones get 2 s, ample for shard 0 alone.
        async def query(
            require_complete: bool = False, timeout: float = 2.0
        ) -> tuple[IndexResult, float]:
            router = ShardRouter(cluster.addresses)
            try:
                start = time.monotonic()
                strong = IndexQuery(
                    vectors[:3],
                    10,
                    consistency=Consistency.STRONG,
                    require_complete=require_complete,
                )
                result = await router.search(strong, timeout=timeout)
                return result, time.monotonic() - start
            finally:
                await router.close()

        full, _ = asyncio.run(query(timeout=30.0))
        assert full.missing_shards == []

        hung = cluster.replica(1).process
        assert hung is not None
        os.kill(hung.pid, signal.SIGSTOP)  # alive but silent: the deadline decides
        try:
            partial, took = asyncio.run(query())
            # The stopped replica never answers: a router that waited for it would not
            # return at all; 6 s (3x the deadline) leaves room for a busy CI machine.
            assert partial.missing_shards == [1] and took < 6.0
            assert all(h.shard == 0 for row in partial.hits for h in row)
            from_shard_0 = [h for h in full.hits[0] if h.shard == 0]
            assert partial.hits[0][: len(from_shard_0)] == from_shard_0
            with pytest.raises(DeadlineExceeded):
                asyncio.run(query(require_complete=True))
        finally:
            os.kill(hung.pid, signal.SIGCONT)

        cluster.replica(1).kill()  # down: connection refused
        partial, took = asyncio.run(query())
        assert partial.missing_shards == [1] and took < 6.0
        with pytest.raises(Unavailable):
            asyncio.run(query(require_complete=True))


def test_replica_failover_within_a_shard(
    index_dir: Path, any_redis_url: str, vectors: np.ndarray, tmp_path: Path
) -> None:
    with run_shards(index_dir, any_redis_url, tmp_path, shards=1, replicas=2) as cluster:
        asyncio.run(_upsert(any_redis_url, vectors, 50))
        cluster.replica(0, 0).kill()

        async def run() -> list[IndexResult]:
            router = ShardRouter(cluster.addresses)
            strong = IndexQuery(vectors[:1], 5, consistency=Consistency.STRONG)
            try:
                return [await router.search(strong, timeout=5) for _ in range(4)]
            finally:
                await router.close()

        for result in asyncio.run(run()):
            assert result.missing_shards == [] and result.hits[0][0].id == "0"


async def _upsert(redis_url: str, vectors: np.ndarray, n: int) -> None:
    writer = ChangeLogWriter.connect(redis_url, 1, dim=384)
    try:
        await writer.upsert([DocRecord(str(i), vectors[i]) for i in range(n)])
    finally:
        await writer.close()
