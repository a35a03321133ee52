"""A shard replica in-process against a real Redis: its consumer thread's FAISS threads."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import faiss
import pytest

from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.changes import Change
from services.index.core.shard import ApplyResult
from services.index.server.replica import ShardReplica
from services.index.server.settings import ShardSettings
from tests.support.processes import run_redis
from tests.support.shards import scifact_vectors, shared_test_index


def test_the_consumer_thread_applies_with_the_configured_omp_threads(
    scifact_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # OpenMP's thread count is per thread: the consumer thread (adds, PQ encoding) would
    # otherwise use the process default, every core, beside the searches.
    vectors = scifact_vectors(scifact_dir)
    index_dir = shared_test_index(tmp_path_factory.getbasetemp(), vectors)
    with run_redis(tmp_path / "redis") as redis_server:
        config = ShardSettings(
            shard=0,
            shards=1,
            replica="r0",
            redis_url=redis_server.url,
            index_dir=str(index_dir),
            snapshot_dir=str(tmp_path / "snapshots"),
            omp_threads=3,
        )
        replica = ShardReplica(config)
        seen: list[int] = []
        original = replica.shard.apply

        def recording(
            changes: Sequence[Change], position: str, refresh: bool = True
        ) -> ApplyResult:
            seen.append(faiss.omp_get_max_threads())
            return original(changes, position, refresh)

        replica.shard.apply = recording  # type: ignore[method-assign]

        async def run() -> None:
            replica.start(asyncio.get_running_loop())
            writer = ChangeLogWriter.connect(redis_server.url, 1, dim=vectors.shape[1])
            try:
                token = await writer.upsert([DocRecord(f"d{i}", vectors[i]) for i in range(5)])
                await replica.wait_for(token[0], timeout=30)
            finally:
                await writer.close()
                await asyncio.get_running_loop().run_in_executor(None, replica.stop, False)
                await replica.close()

        asyncio.run(run())
    assert seen and set(seen) == {3}
    assert all(replica.shard.contains(f"d{i}") for i in range(5))
