"""A shard replica whose log consumer thread has died says so on its health service.

A real replica process (``python -m services.index.server.process``) on a real Redis.
Its consumer thread is made to die for real, by the replica's own failure path: it
snapshots after every applied change, and its snapshot directory has become a file (a
volume gone, as a full disk would fail it too), so the first write to its log is
applied and the snapshot after it raises. The old replica went on answering SERVING
from an index that no longer followed its log; now it answers NOT_SERVING (and stays
so until the process is restarted: see ``ShardReplica.consuming`` for why the thread
is not restarted in place), and a restarted process serves again with the write.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.index.client.writer import ChangeLogWriter, DocRecord
from tests.support.shards import (
    ShardProcess,
    start_shard_that_stops_applying,
    train_test_index,
)


def _status(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        return int(reply.status)


def _await_status(shard: ShardProcess, wanted: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (now := _status(shard.address)) != wanted:
        if time.monotonic() > deadline:
            raise TimeoutError(f"health still {now} after {timeout:.0f} s:\n{shard.log_tail()}")
        time.sleep(0.05)


@pytest.mark.slow
def test_a_shard_whose_log_consumer_died_is_not_serving(
    redis_url: str, scifact_dir: Path, tmp_path: Path
) -> None:
    vectors = np.load(scifact_dir / "corpus.all-MiniLM-L6-v2.npy")[:2000].astype(np.float32)
    index_dir = train_test_index(vectors, tmp_path / "index", nlist=8)
    shard = start_shard_that_stops_applying(index_dir, redis_url, tmp_path)
    try:
        assert _status(shard.address) == health_pb2.HealthCheckResponse.SERVING

        async def write() -> None:
            writer = ChangeLogWriter.connect(redis_url, num_shards=1, dim=vectors.shape[1])
            await writer.upsert([DocRecord("doc-0", vectors[0], "t", "x")])
            await writer.close()

        asyncio.run(write())
        _await_status(shard, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert "log consumer of shard 0 stopped" in shard.log_path.read_text()
        assert shard.alive  # the process is left to its supervisor (liveness probe)

        shard.kill()
        shard.snapshot_dir.unlink()
        shard.launch()  # replays the log from the start: the write is applied
        assert _status(shard.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        shard.kill()
