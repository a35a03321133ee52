"""The log consumer's text refreshes against a real Redis and the real change-log writer
(services/index/server/refresh.py): a trickle of writes costs a refresh per interval, not
per batch; a SESSION wait does not wait for the interval; with no wait the text still
becomes searchable on schedule."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from services.common import positions
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.server.replica import ShardReplica
from services.index.server.settings import ShardSettings
from tests.support.processes import RedisServer, run_redis, wait_until
from tests.support.shards import scifact_vectors, shared_test_index

WORDS = ["okapi", "zebra", "giraffe", "gnu", "emu", "ibis", "kudu", "lynx", "mole", "newt"]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with run_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def vectors(scifact_dir: Path) -> np.ndarray:
    return scifact_vectors(scifact_dir)


@pytest.fixture
def index_dir(vectors: np.ndarray, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_test_index(tmp_path_factory.getbasetemp(), vectors)


def replica(url: str, index_dir: Path, snapshots: Path, refresh_s: float) -> ShardReplica:
    redis.Redis.from_url(url).flushall()  # each test its own log
    return ShardReplica(
        ShardSettings(
            shard=0,
            shards=1,
            replica="r",
            redis_url=url,
            index_dir=str(index_dir),
            snapshot_dir=str(snapshots),
            snapshot_every_entries=1_000_000,
            snapshot_every_s=3600,
            text_refresh_s=refresh_s,
        )
    )


def found(r: ShardReplica, word: str) -> list[str]:
    shard = r.shard
    return [d for d, _ in shard.search_text(shard.query_terms([word]), 5).hits()[0]]


def staged(r: ShardReplica, position: str) -> Callable[[], bool]:
    return lambda: positions.at_least(r.shard.staged, position)


def run(
    r: ShardReplica, url: str, dim: int, body: Callable[[ChangeLogWriter], Awaitable[None]]
) -> None:
    """Start ``r``, wait until it has replayed its log, run ``body`` with a writer of
    that log, then stop both."""

    async def main() -> None:
        r.start(asyncio.get_running_loop())
        writer = ChangeLogWriter.connect(url, 1, dim=dim)
        try:
            assert await asyncio.to_thread(r.ready.wait, 30), "the replica never got ready"
            await body(writer)
        finally:
            await writer.close()
            await asyncio.get_running_loop().run_in_executor(None, r.stop, False)
            await r.close()

    asyncio.run(main())


def test_a_trickle_of_writes_is_refreshed_per_interval_not_per_batch(
    redis_server: RedisServer, vectors: np.ndarray, index_dir: Path, tmp_path: Path
) -> None:
    """Ten writes 60 ms apart, each its own batch: the vectors hold each at once, the text
    gets them in at most elapsed ÷ 0.5 s + 1 refreshes (a refresh per batch: 10)."""
    r = replica(redis_server.url, index_dir, tmp_path / "s", refresh_s=0.5)

    async def body(writer: ChangeLogWriter) -> None:
        start, batches = time.monotonic(), 0
        for i, word in enumerate(WORDS):
            token = await writer.upsert([DocRecord(word, vectors[i], text=word)])
            await asyncio.to_thread(wait_until, staged(r, token[0]), "the vectors", 10)
            batches += 1
            await asyncio.sleep(0.06)  # a trickle: the next write comes later
        await asyncio.to_thread(wait_until, lambda: not r.shard.pending, "the last refresh", 10)
        elapsed = time.monotonic() - start
        assert [found(r, w) for w in WORDS] == [[w] for w in WORDS]
        assert r.refresher.refreshes <= elapsed / 0.5 + 1 < batches, (
            r.refresher.refreshes,
            elapsed,
        )

    run(r, redis_server.url, vectors.shape[1], body)


def test_a_session_wait_refreshes_at_once(
    redis_server: RedisServer, vectors: np.ndarray, index_dir: Path, tmp_path: Path
) -> None:
    """With a refresh every 10 minutes, a search waiting for its write's position gets
    it searchable in the text within seconds: the wait asks for the refresh."""
    r = replica(redis_server.url, index_dir, tmp_path / "s", refresh_s=600)

    async def body(writer: ChangeLogWriter) -> None:
        for i, word in enumerate(WORDS[:3]):
            token = await writer.upsert([DocRecord(word, vectors[i], text=word)])
            await r.wait_for(token[0], timeout=10)
            assert found(r, word) == [word]

    run(r, redis_server.url, vectors.shape[1], body)


def test_without_a_wait_the_text_follows_on_schedule(
    redis_server: RedisServer, vectors: np.ndarray, index_dir: Path, tmp_path: Path
) -> None:
    r = replica(redis_server.url, index_dir, tmp_path / "s", refresh_s=0.25)

    async def body(writer: ChangeLogWriter) -> None:
        token = await writer.upsert([DocRecord("emu", vectors[0], text="emu")])
        await asyncio.to_thread(
            wait_until, lambda: found(r, "emu") == ["emu"], "the text searchable", 10
        )
        assert positions.at_least(r.shard.applied, token[0])

    run(r, redis_server.url, vectors.shape[1], body)
