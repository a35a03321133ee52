"""Shard servers (real processes, real Redis) behind the router, as the gateway uses them.

One cluster of 2 shards × 2 replicas holds the 4,683 first SciFact documents for the
whole module; the other 500 documents are the held-out queries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import faiss
import grpc
import numpy as np
import pytest
import redis

from retrieval.v1 import common_pb2, index_pb2, index_pb2_grpc
from services.common import positions
from services.common.domain import IndexResult
from services.common.errors import DeadlineExceeded, InvalidArgument
from services.common.positions import WriteToken, merge_tokens
from services.index import convert
from services.index.changelog import text
from services.index.client.router import ShardRouter
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.query import Consistency, IndexQuery
from services.index.core.trained import Manifest
from services.index.keys import log_key, replicas_seen_key, snapshot_positions_key
from tests.support.log_end import log_end_moved
from tests.support.processes import wait_until
from tests.support.shards import ShardCluster, run_shards, scifact_vectors, shared_test_index

# Slow as a whole: sharded, replicated services built from the SciFact vectors (a 35-s setup).
pytestmark = pytest.mark.slow

N_BASE = 4683
SHARDS = 2
HEARTBEAT_S = 0.5  # short, so that a test sees idle replicas re-register
REDIS_DB = 3  # module_redis: the cluster outlives the per-test flush of db 0


@pytest.fixture(scope="module")
def vectors(scifact_dir: Path) -> np.ndarray:
    return scifact_vectors(scifact_dir)


@pytest.fixture(scope="module")
def cluster(
    vectors: np.ndarray, module_redis: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ShardCluster]:
    index_dir = shared_test_index(tmp_path_factory.getbasetemp(), vectors)

    async def load() -> None:
        writer = ChangeLogWriter.connect(module_redis, SHARDS, dim=384)
        try:
            for i in range(0, N_BASE, 500):
                await writer.upsert(
                    [
                        DocRecord(str(j), vectors[j], text=f"doc {j}", metadata={"par": str(j % 2)})
                        for j in range(i, min(i + 500, N_BASE))
                    ]
                )
        finally:
            await writer.close()

    asyncio.run(load())  # logged before the shards start: they replay it
    with run_shards(
        index_dir,
        module_redis,
        tmp_path_factory.mktemp("cluster"),
        shards=SHARDS,
        replicas=2,
        settings={"heartbeat-s": str(HEARTBEAT_S)},
    ) as running:
        yield running


def search(cluster: ShardCluster, query: IndexQuery, timeout: float | None = None) -> IndexResult:
    async def run() -> IndexResult:
        router = ShardRouter(cluster.addresses)
        try:
            return await router.search(query, timeout)
        finally:
            await router.close()

    return asyncio.run(run())


def test_sharded_index_matches_exact_search(cluster: ShardCluster, vectors: np.ndarray) -> None:
    queries = vectors[N_BASE:]
    flat = faiss.IndexFlatIP(384)
    flat.add(vectors[:N_BASE])
    _, exact = flat.search(queries, 10)
    strong = IndexQuery(queries[:256], 10, nprobe=32, consistency=Consistency.STRONG)
    result = search(cluster, strong, timeout=30)
    result2 = search(cluster, IndexQuery(queries[256:], 10, nprobe=32), timeout=30)
    hits = result.hits + result2.hits
    assert result.missing_shards == [] and len(hits) == len(queries)
    recall = np.mean(
        [
            len({int(h.id) for h in row} & set(truth.tolist())) / 10
            for row, truth in zip(hits, exact, strict=True)
        ]
    )
    assert recall >= 0.95, recall
    assert {h.shard for row in hits for h in row} == {0, 1}
    for row in hits:
        assert [h.score for h in row] == sorted((h.score for h in row), reverse=True)


def test_replicas_answer_identical_top_k(cluster: ShardCluster, vectors: np.ndarray) -> None:
    queries = vectors[N_BASE : N_BASE + 200]
    for shard in range(SHARDS):
        answers = []
        for replica in cluster.processes[shard]:
            with grpc.insecure_channel(replica.address) as channel:
                reply = index_pb2_grpc.IndexShardServiceStub(channel).Search(
                    index_pb2.ShardSearchRequest(
                        shard=shard,
                        queries=convert.vectors_to_pb(queries),
                        k=10,
                        consistency=common_pb2.CONSISTENCY_STRONG,
                    ),
                    timeout=30,
                )
            answers.append(convert.answer_from_pb(reply))
        first, second = answers
        assert first.applied_position == second.applied_position
        assert first.top == second.top
        assert first.replica != second.replica


def test_session_reads_see_own_writes_and_deletes(
    cluster: ShardCluster, module_redis: str, vectors: np.ndarray
) -> None:
    async def run() -> None:
        writer = ChangeLogWriter.connect(module_redis, SHARDS, dim=384)
        router = ShardRouter(cluster.addresses)
        try:
            rng = np.random.default_rng(7)
            for i in range(10):
                v = rng.standard_normal(384).astype(np.float32)
                v /= np.linalg.norm(v)
                token = await writer.upsert([DocRecord(f"session-{i}", v)])
                query = IndexQuery(v[None], 1, consistency=Consistency.SESSION, write_token=token)
                found = await router.search(query, timeout=5)
                assert found.hits[0][0].id == f"session-{i}"
                token, _, _ = await writer.delete([f"session-{i}"])
                query = IndexQuery(v[None], 10, consistency=Consistency.SESSION, write_token=token)
                found = await router.search(query, timeout=5)
                assert all(h.id != f"session-{i}" for h in found.hits[0])
        finally:
            await writer.close()
            await router.close()

    asyncio.run(run())


def test_strong_reads_see_every_acknowledged_write(
    cluster: ShardCluster, module_redis: str
) -> None:
    async def run() -> None:
        writer = ChangeLogWriter.connect(module_redis, SHARDS, dim=384)
        router = ShardRouter(cluster.addresses)
        try:
            rng = np.random.default_rng(8)
            v = rng.standard_normal((20, 384)).astype(np.float32)
            v /= np.linalg.norm(v, axis=1, keepdims=True)
            await writer.upsert([DocRecord(f"strong-{i}", v[i]) for i in range(20)])
            found = await router.search(IndexQuery(v, 1, consistency=Consistency.STRONG), timeout=5)
            assert [row[0].id for row in found.hits] == [f"strong-{i}" for i in range(20)]
        finally:
            await writer.close()
            await router.close()

    asyncio.run(run())


def test_upsert_delete_upsert_deleted_never_comes_back(
    cluster: ShardCluster, module_redis: str, vectors: np.ndarray
) -> None:
    async def run() -> None:
        writer = ChangeLogWriter.connect(module_redis, SHARDS, dim=384)
        router = ShardRouter(cluster.addresses)
        a, b = vectors[N_BASE + 300], vectors[N_BASE + 301]
        try:
            t1 = await writer.upsert([DocRecord("cycle", a)])
            t2, _, _ = await writer.delete(["cycle"])
            t3 = await writer.upsert([DocRecord("cycle", b)])
            t4, _, _ = await writer.delete(["cycle"])
            token: WriteToken = merge_tokens(t1, t2, t3, t4)
            for _ in range(5):
                query = IndexQuery(
                    np.stack([a, b]), 50, consistency=Consistency.SESSION, write_token=token
                )
                found = await router.search(query, timeout=5)
                assert all(h.id != "cycle" for row in found.hits for h in row)
            t5 = await writer.upsert([DocRecord("cycle", b)])
            query = IndexQuery(b[None], 1, consistency=Consistency.SESSION, write_token=t5)
            found = await router.search(query, timeout=5)
            assert found.hits[0][0].id == "cycle"
        finally:
            await writer.close()
            await router.close()

    asyncio.run(run())


def test_filters_pass_through_the_router(cluster: ShardCluster, vectors: np.ndarray) -> None:
    filtered = IndexQuery(vectors[N_BASE : N_BASE + 8], 20, filter=[("par", ["1"])])
    found = search(cluster, filtered, timeout=10)
    assert all(int(h.id) % 2 == 1 for row in found.hits for h in row)
    assert all(len(row) == 20 for row in found.hits)


def stats(address: str) -> index_pb2.ShardStats:
    with grpc.insecure_channel(address) as channel:
        reply: index_pb2.ShardStats = index_pb2_grpc.IndexShardServiceStub(channel).Stats(
            index_pb2.ShardStatsRequest(), timeout=10
        )
        return reply


def _queries(v: np.ndarray) -> Callable[[index_pb2.ShardSearchRequest], None]:
    return lambda r: r.queries.CopyFrom(convert.vectors_to_pb(v))


def _session_at(position: str) -> Callable[[index_pb2.ShardSearchRequest], None]:
    def mutate(r: index_pb2.ShardSearchRequest) -> None:
        r.consistency = common_pb2.CONSISTENCY_SESSION
        r.min_position = position

    return mutate


def settled(redis_url: str, address: str, shard: int = 0) -> index_pb2.ShardStats:
    """A replica's stats once it has applied its shard log's last entry: the earlier
    tests' writes reach each replica on its own schedule (a CI run saw replica 0 apply
    one in the middle of a test that compares its position before and after)."""
    client = redis.Redis.from_url(redis_url)
    try:
        last = client.xrevrange(log_key(shard), count=1)
    finally:
        client.close()
    end = text(last[0][0]) if last else "0-0"  # type: ignore[index, arg-type]
    wait_until(
        lambda: positions.at_least(stats(address).applied_position or "0-0", end),
        f"the replica at {address} applied its log to {end}",
    )
    return stats(address)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_queries(np.ones((1, 100), np.float32)), "dimension"),
        (_queries(np.full((1, 384), np.nan, np.float32)), "NaN"),
        (_queries(np.full((1, 384), np.inf, np.float32)), "NaN"),
        (lambda r: setattr(r, "k", 0), "k"),
        (lambda r: setattr(r, "k", 1001), "k"),
        (lambda r: setattr(r, "nprobe", 100_000), "nprobe"),
        (lambda r: setattr(r, "shard", 7), "shard"),
        (lambda r: setattr(r.queries, "count", 2), "bytes"),
        (_session_at("soon"), "position"),
    ],
)
def test_invalid_requests_are_invalid_argument_and_change_nothing(
    cluster: ShardCluster, vectors: np.ndarray, mutate: object, message: str, module_redis: str
) -> None:
    replica = cluster.replica(0)
    before = settled(module_redis, replica.address)
    request = index_pb2.ShardSearchRequest(
        shard=0, queries=convert.vectors_to_pb(vectors[:1]), k=10
    )
    mutate(request)  # type: ignore[operator]
    with grpc.insecure_channel(replica.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            index_pb2_grpc.IndexShardServiceStub(channel).Search(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    after = stats(replica.address)
    assert (after.vectors, after.applied_position) == (before.vectors, before.applied_position)


def test_router_keeps_errors_meaningful(
    cluster: ShardCluster, vectors: np.ndarray, module_redis: str
) -> None:
    def session(token: WriteToken, require_complete: bool = False) -> IndexQuery:
        return IndexQuery(
            vectors[:1],
            5,
            consistency=Consistency.SESSION,
            write_token=token,
            require_complete=require_complete,
        )

    with pytest.raises(InvalidArgument, match="k"):
        search(cluster, IndexQuery(vectors[:1], 0), timeout=5)
    with pytest.raises(InvalidArgument, match="unknown shards"):
        search(cluster, session({9: "1-0"}))
    # a position past the end of shard 0's log: refused, never waited for
    past = {0: "99999999999999-0"}
    with pytest.raises(InvalidArgument, match="shard 0"):
        search(cluster, session(past))
    # a position no shard will reach in time: the deadline, not a hang
    with log_end_moved(module_redis, [0]) as far_position:
        far = {0: far_position}
        # 3 s: shard 1 (and a new router's channels) answer in time on a slow machine too
        with pytest.raises(DeadlineExceeded):
            search(cluster, session(far, require_complete=True), timeout=3)
        partial = search(cluster, session(far), timeout=3)
        assert partial.missing_shards == [0] and all(h.shard == 1 for h in partial.hits[0])


def test_stats_report_the_shard(
    cluster: ShardCluster, vectors: np.ndarray, tmp_path_factory: pytest.TempPathFactory
) -> None:
    manifest = Manifest.read(shared_test_index(tmp_path_factory.getbasetemp(), vectors))

    async def run() -> list[list[index_pb2.ShardStats | None]]:
        router = ShardRouter(cluster.addresses)
        try:
            return await router.stats()
        finally:
            await router.close()

    every = asyncio.run(run())
    assert len(every) == SHARDS and all(len(r) == 2 for r in every)
    total = 0
    for shard, replicas in enumerate(every):
        for s in replicas:
            assert s is not None and s.shard == shard and s.dim == 384 and s.metric == "IP"
            assert s.factory.startswith("IVF") and s.model == "all-MiniLM-L6-v2"
            assert s.bytes_per_vector == 96 + 8 + 384 and 0.5 < s.pq_error_ratio < 1.5
            assert s.list_imbalance >= 1.0 and s.memory_bytes > 0
            # the default nprobe, tuned at training to the target recall, and what it measured
            assert s.nprobe == manifest.nprobe and s.target_recall == 0.99
            assert s.measured_recall == manifest.measured_recall and s.measured_recall >= 0.99
            assert s.ivf_advice.startswith("IVF is the wrong choice for 5183 vectors")
        assert replicas[0] is not None
        total += replicas[0].vectors
    assert total >= N_BASE


def test_concurrent_single_queries_coalesce_to_the_same_answers(
    cluster: ShardCluster, vectors: np.ndarray
) -> None:
    queries = vectors[N_BASE : N_BASE + 64]

    async def run(coalesce: bool) -> list[IndexResult]:
        router = ShardRouter(cluster.addresses, coalesce=coalesce)
        try:
            return list(
                await asyncio.gather(
                    *[
                        router.search(IndexQuery(q[None], 3 + i % 5, nprobe=16), timeout=10)
                        for i, q in enumerate(queries)
                    ]
                )
            )
        finally:
            await router.close()

    together, alone = asyncio.run(run(True)), asyncio.run(run(False))
    assert [r.hits for r in together] == [r.hits for r in alone]
    assert all(len(r.hits[0]) == 3 + i % 5 for i, r in enumerate(together))


def test_search_stream_answers_each_message_with_its_own_status(
    cluster: ShardCluster, vectors: np.ndarray
) -> None:
    """The router's stream: tagged answers, a bad search fails alone, the stream goes on;
    a malformed message ends the stream with INVALID_ARGUMENT."""
    address = cluster.replica(0).address

    def request(tag: int, k: int, timeout_us: int = 5_000_000) -> index_pb2.ShardStreamRequest:
        search = index_pb2.ShardSearchRequest(
            shard=0, queries=convert.vectors_to_pb(vectors[N_BASE : N_BASE + 2]), k=k
        )
        return index_pb2.ShardStreamRequest(tag=tag, search=search, timeout_us=timeout_us)

    with grpc.insecure_channel(address) as channel:
        stub = index_pb2_grpc.IndexShardServiceStub(channel)
        replies = list(stub.SearchStream(iter([request(7, 5), request(8, 0), request(9, 3)])))
        by_tag = {r.tag: r for r in replies}
        assert sorted(by_tag) == [7, 8, 9]
        assert by_tag[8].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "k: 0 is out of range" in by_tag[8].status_message
        for tag, k in ((7, 5), (9, 3)):
            answer = convert.answer_from_pb(by_tag[tag].result)
            assert by_tag[tag].status_code == 0 and [len(row) for row in answer.top.hits()] == [
                k,
                k,
            ]
        # the same search through the unary call: the same hits
        unary = stub.Search(request(7, 5).search, timeout=10)
        assert convert.answer_from_pb(unary).top == convert.answer_from_pb(by_tag[7].result).top

        raw = channel.stream_stream(
            "/retrieval.v1.IndexShardService/SearchStream",
            request_serializer=lambda b: b,
            response_deserializer=index_pb2.ShardStreamResponse.FromString,
        )
        wrong_type = b"\x08\x05" + b"\x11" + b"\x00" * 8  # field 2 (search) sent as fixed64
        with pytest.raises(grpc.RpcError) as info:
            list(raw(iter([request(1, 5).SerializeToString(), wrong_type]), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed" in (info.value.details() or "")


def test_replicas_register_as_alive(cluster: ShardCluster, module_redis: str) -> None:
    """Each replica records its log floor and, idle or not, re-registers every
    ``--heartbeat-s`` (what keeps it from being taken for a removed replica)."""
    client = redis.Redis.from_url(module_redis)

    def seen() -> dict[Any, float]:
        return {
            r: float(t)
            for shard in range(SHARDS)
            for r, t in client.hgetall(replicas_seen_key(shard)).items()
        }

    before = seen()
    for shard in range(SHARDS):
        floors = client.hgetall(snapshot_positions_key(shard))
        assert len(floors) == 2 and set(floors) <= set(before)
    # each re-registers (a heartbeat is every 0.5 s: 30 s is room for a starved thread)
    wait_until(
        lambda: all(seen().get(r, 0.0) > before[r] for r in before),
        "every replica re-registered",
        30,
    )
    assert set(seen()) == set(before)


def test_shared_quantizer_gives_the_same_answers_and_survives_a_stale_copy(
    cluster: ShardCluster, vectors: np.ndarray
) -> None:
    """The router assigns each batch to its lists once for all shards: same hits as the
    shards assigning themselves; a router holding other centroids (the index was
    retrained) is refused, answers anyway, and drops its copy."""
    from services.index.core.coarse import CoarseQuantizer

    queries = vectors[N_BASE : N_BASE + 200]

    async def run() -> None:
        shared = ShardRouter(cluster.addresses, share_quantizer=True)
        own = ShardRouter(cluster.addresses, share_quantizer=False)
        try:
            a = await shared.search(IndexQuery(queries, 10, nprobe=24), timeout=30)
            b = await own.search(IndexQuery(queries, 10, nprobe=24), timeout=30)
            assert shared._quantizer is not None and own._quantizer is None
            assert a.hits == b.hits and a.missing_shards == b.missing_shards == []
            real = shared._quantizer
            stale = CoarseQuantizer(real.centroids * 1.01, real.metric, real.default_nprobe)
            shared._quantizer = stale
            c = await shared.search(IndexQuery(queries[:20], 10, nprobe=24), timeout=30)
            assert c.hits == b.hits[:20]
            assert shared._quantizer is None  # dropped; fetched again after a while
        finally:
            await shared.close()
            await own.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("probes", "code", "message"),
    [
        (dict(quantizer="elsewhere"), grpc.StatusCode.FAILED_PRECONDITION, "quantizer"),
        (dict(lists=b"\0" * 7), grpc.StatusCode.INVALID_ARGUMENT, "probes"),
        (dict(lists=np.full(8, 10**6, "<i8").tobytes()), grpc.StatusCode.INVALID_ARGUMENT, "0.."),
        (dict(scores=np.full(8, np.nan, "<f4").tobytes()), grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
    ],
)
def test_bad_probes_are_refused(
    cluster: ShardCluster, vectors: np.ndarray, probes: dict, code: grpc.StatusCode, message: str
) -> None:
    address = cluster.replica(0).address
    with grpc.insecure_channel(address) as channel:
        stub = index_pb2_grpc.IndexShardServiceStub(channel)
        q = convert.quantizer_from_pb(stub.Quantizer(index_pb2.QuantizerRequest(), timeout=10))
        good = convert.probes_to_pb(q.assign(vectors[:1], 8))
        request = index_pb2.ShardSearchRequest(
            shard=0, queries=convert.vectors_to_pb(vectors[:1]), k=5, probes=good
        )
        assert len(stub.Search(request, timeout=10).ids) == 5  # the good probes work
        for field, value in probes.items():
            setattr(request.probes, field, value)
        with pytest.raises(grpc.RpcError) as info:
            stub.Search(request, timeout=10)
    assert info.value.code() == code and message in (info.value.details() or "")
