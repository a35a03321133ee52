"""Round trips of every IndexShardService proto ↔ domain conversion."""

from __future__ import annotations

import math

import numpy as np
import pytest

from retrieval.v1 import common_pb2, index_pb2
from services.common.errors import InvalidArgument, Unavailable
from services.index import convert
from services.index.core.query import Consistency, ShardAnswer, ShardQuery, TopK
from services.index.core.shard import ShardStats
from services.index.core.train import Manifest


def test_vectors_round_trip_bit_exact() -> None:
    v = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    pb = convert.vectors_to_pb(v)
    assert (pb.count, pb.dim, len(pb.data)) == (5, 7, 4 * 5 * 7)
    back = convert.vectors_from_pb(common_pb2.VectorBatch.FromString(pb.SerializeToString()))
    assert back.dtype == np.float32 and np.array_equal(back, v)


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (common_pb2.VectorBatch(data=b"", dim=0, count=1), "positive"),
        (common_pb2.VectorBatch(data=b"\0" * 12, dim=4, count=1), "bytes"),
        (common_pb2.VectorBatch(data=b"\0" * 4 * 257, dim=1, count=257), "1..256"),
    ],
)
def test_malformed_vector_batches(batch: common_pb2.VectorBatch, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        convert.vectors_from_pb(batch)


@pytest.mark.parametrize("consistency", list(Consistency))
def test_query_round_trip(consistency: Consistency) -> None:
    query = ShardQuery(
        shard=3,
        vectors=np.arange(8, dtype=np.float32).reshape(2, 4),
        k=17,
        nprobe=9,
        filter=(("lang", ("en", "de")), ("year", ("2020",))),
        consistency=consistency,
        min_position="1700000000000-4",
    )
    wire = index_pb2.ShardSearchRequest.FromString(convert.query_to_pb(query).SerializeToString())
    back = convert.query_from_pb(wire)
    assert np.array_equal(back.vectors, query.vectors)
    assert (back.shard, back.k, back.nprobe, back.filter, back.consistency, back.min_position) == (
        3, 17, 9, query.filter, consistency, "1700000000000-4",
    )  # fmt: skip


def test_unspecified_consistency_is_eventual_and_unknown_is_rejected() -> None:
    req = index_pb2.ShardSearchRequest(
        shard=0, queries=convert.vectors_to_pb(np.ones((1, 2), np.float32)), k=1
    )
    assert convert.query_from_pb(req).consistency is Consistency.EVENTUAL
    req.consistency = 42  # type: ignore[assignment]
    with pytest.raises(InvalidArgument, match="consistency"):
        convert.query_from_pb(req)


def test_answer_round_trip() -> None:
    answer = ShardAnswer(
        top=TopK.from_hits([[("a", 0.5), ("b", 0.25)], [], [("c", -1.0)]]),
        shard=1,
        replica="shard-1-r0",
        applied_position="5-1",
    )
    wire = index_pb2.ShardSearchResponse.FromString(
        convert.answer_to_pb(answer).SerializeToString()
    )
    assert convert.answer_from_pb(wire) == answer
    assert convert.answer_from_pb(wire).hits == [[("a", 0.5), ("b", 0.25)], [], [("c", -1.0)]]


def test_a_malformed_answer_is_an_outage_not_a_crash() -> None:
    bad = index_pb2.ShardSearchResponse(width=2, ids=["a", "b"], scores=b"\0" * 4, shard=3)
    with pytest.raises(Unavailable, match="shard 3"):
        convert.answer_from_pb(bad)
    with pytest.raises(Unavailable):
        convert.answer_from_pb(index_pb2.ShardSearchResponse(width=0, ids=["a"], scores=b"\0" * 4))


def test_stats_to_pb_carries_every_field() -> None:
    stats = ShardStats(
        vectors=10, deleted=2, applied_position="9-0", bytes_per_vector=440.0,
        memory_bytes=12345, train_pq_error=0.17, recent_pq_error=0.2,
        pq_error_ratio=0.2 / 0.17, list_imbalance=1.25,
    )  # fmt: skip
    manifest = Manifest(
        dim=384, metric="IP", factory="IVF8,PQ48x8,Refine(SQ8)", model="m", nlist=8, pq_m=48,
        pq_bits=8, refine=True, refine_factor=4, nprobe=4, train_points=100,
        train_pq_error=0.17, train_seconds=1.0, created_at="now",
    )  # fmt: skip
    pb = convert.stats_to_pb(stats, 2, "r", manifest, "8-0", 0.5, gpu=True)
    pb = index_pb2.ShardStats.FromString(pb.SerializeToString())
    assert (pb.shard, pb.replica, pb.dim, pb.factory, pb.metric, pb.model, pb.nlist) == (
        2, "r", 384, manifest.factory, "IP", "m", 8,
    )  # fmt: skip
    assert (pb.vectors, pb.deleted, pb.applied_position, pb.snapshot_position) == (
        10,
        2,
        "9-0",
        "8-0",
    )
    assert pb.memory_bytes == 12345 and pb.gpu
    for name in ("bytes_per_vector", "train_pq_error", "recent_pq_error", "pq_error_ratio",
                 "list_imbalance", "log_lag_seconds"):  # fmt: skip
        expected = getattr(stats, name, 0.5)
        assert math.isclose(getattr(pb, name), expected, rel_tol=1e-6), name
