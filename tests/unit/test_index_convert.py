"""Round trips of every IndexShardService proto ↔ domain conversion."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from retrieval.v1 import common_pb2, index_pb2
from services.common.errors import InvalidArgument, Unavailable
from services.index import convert
from services.index.core.coarse import CoarseQuantizer
from services.index.core.query import PAD_ID, Consistency, Probes, ShardAnswer, ShardQuery, TopK
from services.index.core.shard import ShardStats
from services.index.core.stats import ReplicaStats
from services.index.core.trained import Manifest
from services.index.core.transfer import FileInfo, Offer

UINT32 = st.integers(0, 2**32 - 1)
POSITIONS = st.builds(lambda ms, seq: f"{ms}-{seq}", st.integers(0, 2**48), st.integers(0, 2**32))
F32 = st.floats(width=32, allow_nan=False)


def f32_grid(rows: int, width: int, elements: st.SearchStrategy[float] = F32) -> st.SearchStrategy:
    return hnp.arrays(np.float32, (rows, width), elements=elements)


@st.composite
def top_ks(draw: st.DrawFn) -> TopK:
    """A shard's grid: 1..4 query rows (a shard search has at least one), width = k >= 1,
    any ids, pads ("" with -inf) anywhere."""
    rows, width = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    ids = draw(
        st.lists(
            st.text(min_size=1) | st.just(PAD_ID), min_size=rows * width, max_size=rows * width
        )
    )
    scores = draw(f32_grid(rows, width))
    scores[np.array(ids).reshape(rows, width) == PAD_ID] = -np.inf
    return TopK(ids, scores)


@st.composite
def probe_sets(draw: st.DrawFn, rows: int) -> Probes:
    nprobe = draw(st.integers(1, 6))
    lists = draw(hnp.arrays(np.int64, (rows, nprobe), elements=st.integers(0, 2**40)))
    return Probes(draw(st.text()), lists, draw(f32_grid(rows, nprobe)))


def assert_same_probes(a: Probes, b: Probes) -> None:
    assert a.quantizer == b.quantizer and a.nprobe == b.nprobe
    assert b.lists.dtype == np.int64 and np.array_equal(a.lists, b.lists)
    assert b.scores.dtype == np.float32 and np.array_equal(a.scores, b.scores)


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
        3,
        17,
        9,
        query.filter,
        consistency,
        "1700000000000-4",
    )


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
    assert convert.answer_from_pb(wire).top.hits() == [[("a", 0.5), ("b", 0.25)], [], [("c", -1.0)]]


@given(top_ks(), UINT32, st.text(), POSITIONS, st.integers(0, 2**64 - 1))
def test_any_answer_survives_the_unary_and_the_stream_message(
    top: TopK, shard: int, replica: str, position: str, tag: int
) -> None:
    answer = ShardAnswer(top, shard, replica, position)
    unary = index_pb2.ShardSearchResponse.FromString(
        convert.answer_to_pb(answer).SerializeToString()
    )
    assert convert.answer_from_pb(unary) == answer
    # the stream's message: the answer filled in place into its result, then sent
    reply = index_pb2.ShardStreamResponse(tag=tag)
    convert.answer_to_pb(answer, reply.result)
    streamed = index_pb2.ShardStreamResponse.FromString(reply.SerializeToString())
    assert streamed.tag == tag and streamed.status_code == 0
    assert convert.answer_from_pb(streamed.result) == answer


@given(st.data(), st.integers(1, 4))
def test_any_probe_set_survives_the_wire_alone_and_in_a_request(
    data: st.DataObject, rows: int
) -> None:
    probes = data.draw(probe_sets(rows))
    wire = index_pb2.Probes.FromString(convert.probes_to_pb(probes).SerializeToString())
    assert_same_probes(probes, convert.probes_from_pb(wire, rows))

    vectors = data.draw(f32_grid(rows, 3))
    query = ShardQuery(shard=0, vectors=vectors, k=5, probes=probes)
    request = index_pb2.ShardSearchRequest.FromString(
        convert.query_to_pb(query).SerializeToString()
    )
    back = convert.query_from_pb(request)
    assert back.probes is not None and np.array_equal(back.vectors, vectors)
    assert_same_probes(probes, back.probes)


def test_probes_that_do_not_fit_the_queries_are_invalid_argument() -> None:
    probes = Probes("q", np.zeros((2, 3), np.int64), np.zeros((2, 3), np.float32))
    wire = index_pb2.Probes.FromString(convert.probes_to_pb(probes).SerializeToString())
    with pytest.raises(InvalidArgument, match="probes"):
        convert.probes_from_pb(wire, rows=3)


@given(
    st.integers(1, 8).flatmap(
        lambda nlist: st.integers(1, 8).flatmap(
            lambda dim: f32_grid(nlist, dim, st.floats(-1e6, 1e6, width=32))
        )
    ),
    st.sampled_from(["IP", "L2"]),
    st.integers(1, 8),
)
def test_any_quantizer_survives_the_wire_and_assigns_alike(
    centroids: np.ndarray, metric: str, nprobe: int
) -> None:
    sent = CoarseQuantizer(centroids, metric, nprobe)
    wire = index_pb2.QuantizerReply.FromString(convert.quantizer_to_pb(sent).SerializeToString())
    got = convert.quantizer_from_pb(wire)
    assert (got.id, got.metric, got.nlist, got.dim, got.default_nprobe) == (
        sent.id,
        metric,
        *centroids.shape,
        nprobe,
    )
    assert got.centroids.dtype == np.float32 and np.array_equal(got.centroids, centroids)
    queries = np.random.default_rng(0).standard_normal((3, sent.dim)).astype(np.float32)
    a, b = sent.assign(queries), got.assign(queries)
    assert_same_probes(a, b)


def test_a_quantizer_whose_centroids_do_not_hash_to_its_id_is_refused() -> None:
    reply = convert.quantizer_to_pb(CoarseQuantizer(np.eye(4, dtype=np.float32), "IP", 2))
    reply.id = "0" * 16
    with pytest.raises(Unavailable, match="do not hash"):
        convert.quantizer_from_pb(index_pb2.QuantizerReply.FromString(reply.SerializeToString()))


FILES = st.builds(
    FileInfo,
    name=st.text(min_size=1),
    size=st.integers(0, 2**64 - 1),
    sha256=st.text("0123456789abcdef", min_size=64, max_size=64),
    index=st.booleans(),
)


@given(POSITIONS, st.lists(FILES, max_size=6))
def test_any_snapshot_offer_survives_the_wire(position: str, files: list[FileInfo]) -> None:
    """The first message of a snapshot transfer, as the seeding replica reads it."""
    first = index_pb2.SnapshotChunk.FromString(
        convert.offer_to_pb(Offer(position, files, handles=[])).SerializeToString()
    )
    assert (first.position, convert.files_from_pb(first)) == (position, files)


def test_a_malformed_answer_is_an_outage_not_a_crash() -> None:
    bad = index_pb2.ShardSearchResponse(width=2, ids=["a", "b"], scores=b"\0" * 4, shard=3)
    with pytest.raises(Unavailable, match="shard 3"):
        convert.answer_from_pb(bad)
    with pytest.raises(Unavailable):
        convert.answer_from_pb(index_pb2.ShardSearchResponse(width=0, ids=["a"], scores=b"\0" * 4))


def test_stats_to_pb_carries_every_field() -> None:
    stats = ShardStats(
        vectors=10,
        deleted=2,
        applied_position="9-0",
        bytes_per_vector=440.0,
        memory_bytes=12345,
        train_pq_error=0.17,
        recent_pq_error=0.2,
        pq_error_ratio=0.2 / 0.17,
        list_imbalance=1.25,
    )
    manifest = Manifest(
        dim=384,
        metric="IP",
        factory="IVF8,PQ48x8,Refine(SQ8)",
        model="m",
        nlist=8,
        pq_m=48,
        pq_bits=8,
        refine=True,
        refine_factor=4,
        nprobe=4,
        train_points=100,
        train_pq_error=0.17,
        train_seconds=1.0,
        created_at="now",
    )
    replica = ReplicaStats(
        shard=2,
        replica="r",
        index=stats,
        manifest=manifest,
        snapshot_position="8-0",
        log_lag_s=0.5,
        gpu=True,
        searches=7,
    )
    pb = convert.stats_to_pb(replica)
    pb = index_pb2.ShardStats.FromString(pb.SerializeToString())
    assert (pb.shard, pb.replica, pb.dim, pb.factory, pb.metric, pb.model, pb.nlist) == (
        2,
        "r",
        384,
        manifest.factory,
        "IP",
        "m",
        8,
    )
    assert (pb.vectors, pb.deleted, pb.applied_position, pb.snapshot_position) == (
        10,
        2,
        "9-0",
        "8-0",
    )
    assert pb.memory_bytes == 12345 and pb.gpu and pb.searches == 7
    for name in (
        "bytes_per_vector",
        "train_pq_error",
        "recent_pq_error",
        "pq_error_ratio",
        "list_imbalance",
        "log_lag_seconds",
    ):
        expected = getattr(stats, name, 0.5)
        assert math.isclose(getattr(pb, name), expected, rel_tol=1e-6), name


@given(top_ks(), top_ks(), st.text())
def test_an_answer_with_a_sparse_list_survives_the_wire(
    top: TopK, sparse: TopK, unavailable: str
) -> None:
    answer = ShardAnswer(top, 1, "r", "2-0", sparse=sparse)
    wire = index_pb2.ShardSearchResponse.FromString(
        convert.answer_to_pb(answer).SerializeToString()
    )
    assert convert.answer_from_pb(wire) == answer
    # a replica without text index: no grid, and why
    answer = ShardAnswer(top, 1, "r", "2-0", sparse_unavailable=unavailable)
    wire = index_pb2.ShardSearchResponse.FromString(
        convert.answer_to_pb(answer).SerializeToString()
    )
    assert convert.answer_from_pb(wire) == answer


def test_a_sparse_only_query_crosses_the_wire_without_vectors() -> None:
    query = ShardQuery(
        shard=1, vectors=np.zeros((0, 0), np.float32), k=0, texts=("a b", "c"), sparse_k=7
    )
    wire = index_pb2.ShardSearchRequest.FromString(convert.query_to_pb(query).SerializeToString())
    back = convert.query_from_pb(wire)
    assert (back.texts, back.sparse_k, back.k, back.vectors.shape) == (("a b", "c"), 7, 0, (0, 0))
    hybrid = ShardQuery(1, np.ones((2, 4), np.float32), 5, texts=("a", "b"), sparse_k=9)
    wire = index_pb2.ShardSearchRequest.FromString(convert.query_to_pb(hybrid).SerializeToString())
    back = convert.query_from_pb(wire)
    assert (back.texts, back.sparse_k, back.k) == (("a", "b"), 9, 5)
    assert np.array_equal(back.vectors, hybrid.vectors)


@given(
    st.integers(0, 5).flatmap(
        lambda n: st.tuples(
            st.lists(st.text(min_size=1), min_size=n, max_size=n),
            f32_grid(n, 3),
            POSITIONS,
        )
    )
)
def test_any_exported_chunk_survives_the_wire(chunk: tuple[list[str], np.ndarray, str]) -> None:
    """ExportVectors: (ids, vectors, position) bit-exact, an empty chunk included."""
    ids, vectors, position = chunk
    reply = index_pb2.VectorChunk.FromString(
        convert.vector_chunk_to_pb(ids, vectors, position, 1, "g2").SerializeToString()
    )
    got_ids, got, got_position = convert.vector_chunk_from_pb(reply)
    assert got_ids == ids and got_position == position and got.shape == (len(ids), 3)
    assert got.tobytes() == vectors.astype("<f4").tobytes()
    assert (reply.shard, reply.generation) == (1, "g2")


def test_export_batches_default_to_2_mib_and_refuse_more_than_8() -> None:
    assert convert.export_batch(0, 384) == (2 << 20) // (4 * 384)
    assert convert.export_batch(100, 384) == 100
    assert convert.export_batch(0, 10**7) == 1  # a vector wider than 2 MiB: one a message
    with pytest.raises(InvalidArgument, match="takes at most 5461"):
        convert.export_batch(5462, 384)
    with pytest.raises(InvalidArgument, match="takes at most 65536"):
        convert.export_batch(65537, 8)
