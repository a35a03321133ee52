"""`gtr-retrieval up --replicas 2` on a run directory whose log was trimmed: the new
replica seeds itself from its peer (each replica's ``--peers`` names the others).

Real children started by the ``components`` functions ``up`` uses (a real redis-server
that reloads its AOF, real shard processes under the supervisor), in ``up``'s order: a
first run with one replica per shard, whose snapshot trims the log, then a second run
on the same directory with two.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis

from retrieval.v1 import index_pb2, index_pb2_grpc
from services.common import positions
from services.index import convert
from services.index.changelog import LogReader
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.query import Consistency, ShardQuery
from services.stack import components
from services.stack.children import Child, RestartPolicy, Supervisor
from services.stack.config import StackConfig
from tests.support.processes import redis_binary

DIM = 384
FAST = RestartPolicy(backoff_s=0.05, backoff_max_s=0.2, max_restarts=2, window_s=60, poll_s=0.05)


def _vectors(n: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return np.asarray(v / np.linalg.norm(v, axis=1, keepdims=True))


def _upsert(url: str, vectors: np.ndarray, first: int) -> None:
    async def run() -> None:
        writer = ChangeLogWriter.connect(url, num_shards=1, dim=DIM)
        try:
            for i in range(0, len(vectors), 200):
                batch = vectors[i : i + 200]
                await writer.upsert(
                    [DocRecord(f"d{first + i + j}", v) for j, v in enumerate(batch)]
                )
        finally:
            await writer.close()

    asyncio.run(run())


def _start(cfg: StackConfig, sup: Supervisor) -> tuple[Child, list[Child]]:
    """Redis, then the replicas of shard 0 one after the other, as ``up`` starts them."""
    store = components.redis_child(cfg)
    sup.start(store, lambda: components.redis_ready(store), 30)
    ports = components.shard_ports(cfg)
    replicas = []
    for r in range(cfg.replicas):
        child = components.shard_child(cfg, 0, r, ports)
        sup.start(child, lambda c=child: components.grpc_ready(c), 120)  # type: ignore[misc]
        replicas.append(child)
    return store, replicas


def _search(address: str, queries: np.ndarray) -> tuple[list[str], np.ndarray]:
    request = convert.query_to_pb(
        ShardQuery(shard=0, vectors=queries, k=10, consistency=Consistency.STRONG)
    )
    with grpc.insecure_channel(address) as channel:
        reply = index_pb2_grpc.IndexShardServiceStub(channel).Search(request, timeout=30)
    answer = convert.answer_from_pb(reply)
    return answer.top.ids, answer.top.scores


@pytest.mark.slow
def test_up_with_two_replicas_on_a_trimmed_run_dir_seeds_the_new_one(tmp_path: Path) -> None:
    if redis_binary() is None:
        pytest.fail("redis-server is not installed (scripts/bootstrap.sh installs it)")
    from services.index.core.train import TrainOptions, train_index

    run_dir = tmp_path / "run"
    one = StackConfig(run_dir=run_dir, shards=1, replicas=1, restart=FAST)
    train_index(_vectors(1000, 0), one.index_dir, TrainOptions(nlist=8, pq_m=8, pq_bits=4))
    vectors = _vectors(1500, 1)

    sup = Supervisor(one.restart, report=lambda _: None)
    try:
        store, (first,) = _start(one, sup)
        redis_url = store.address
        _upsert(redis_url, vectors[:1000], 0)
        with grpc.insecure_channel(first.address) as channel:  # snapshot + trim
            index_pb2_grpc.IndexShardServiceStub(channel).Snapshot(
                index_pb2.SnapshotRequest(), timeout=60
            )
        reader = LogReader(redis.Redis.from_url(redis_url), 0)
        assert reader.trimmed_past(positions.ZERO)
        _upsert(redis_url, vectors[1000:], 1000)  # after the snapshot: replayed on top
    finally:
        sup.stop_all()

    two = StackConfig(run_dir=run_dir, shards=1, replicas=2, restart=FAST)
    sup = Supervisor(two.restart, report=lambda _: None)
    try:
        _, (old, new) = _start(two, sup)  # fails today: replica 1 cannot replay the log
        assert any(two.snapshot_dir(0, 1).glob("snap-*.npz"))
        queries = _vectors(30, 2)
        want_ids, want_scores = _search(old.address, queries)
        ids, scores = _search(new.address, queries)
        assert ids == want_ids
        np.testing.assert_array_equal(scores, want_scores)
        assert sum(i != "" for i in ids) == 300
    finally:
        sup.stop_all()
