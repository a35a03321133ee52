"""Shard replicas of another index generation (issue #24, docs/generations.md): real shard
processes of generation g2 with 3 shards, beside a base store of 2 shards (generation g1),
on a real Redis; they follow ``log:{3.s}:g2``, register and answer searches, export the
vectors they hold (ExportVectors), and refuse what is not theirs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import grpc
import numpy as np
import pytest

from retrieval.v1 import common_pb2, index_pb2, index_pb2_grpc
from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.positions import compare
from services.generations.registry import EncoderSpec, Registry
from services.index import convert
from services.index.client.export import export_vectors
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.trained import TrainedIndex
from services.index.keys import GenerationKeys, Layout, log_key
from services.index.layout import check_layout
from services.index.server.replica import ShardReplica
from services.index.server.settings import ShardSettings
from services.process.redis_client import sync_client
from tests.support.processes import free_port
from tests.support.shards import ShardProcess, start_shard, train_test_index

REDIS_DB = 13  # module_redis: the shards outlive the per-test flush of db 0
DIM = 32
BASE = 2
G2 = GenerationKeys("g2", Layout(3, BASE))
N_DOCS = 300
SPEC = EncoderSpec("embed", 1, DIM, "test")


def unit(rows: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((rows, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@dataclass
class Store:
    url: str
    index_dir: Path
    vectors: dict[str, np.ndarray]  # what g2's logs hold, by id
    shards: list[ShardProcess]  # g2's, one replica each
    work: Path


@pytest.fixture(scope="module")
def store(module_redis: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    work = tmp_path_factory.mktemp("generation-shards")
    index_dir = train_test_index(unit(3000, 0), work / "index", nlist=16)
    client = sync_client(module_redis)
    check_layout(client, BASE)  # the base store: 2 shards, generation g1
    registry = Registry(client)
    registry.ensure_first(BASE, SPEC, str(index_dir))
    g2 = registry.create(3, SPEC, str(index_dir), {"trained": True})
    assert g2.name == "g2"
    registry.set_gates(G2.layout, "g2")  # as a rollout's switch opens them

    vectors = unit(N_DOCS, 1)
    docs = {f"doc-{i}": vectors[i] for i in range(N_DOCS)}

    async def load() -> None:
        g1 = ChangeLogWriter.connect(module_redis, BASE, dim=DIM)  # the base store's own
        writer = ChangeLogWriter.connect(module_redis, BASE, dim=DIM, keys=G2)
        try:
            await g1.upsert([DocRecord("only-in-g1", unit(1, 9)[0], text="g1")])
            ids = list(docs)
            for i in range(0, N_DOCS, 100):
                batch = ids[i : i + 100]
                await writer.upsert([DocRecord(d, docs[d], text=d) for d in batch])
            await writer.delete(["doc-0", "doc-1"])
        finally:
            await g1.close()
            await writer.close()

    asyncio.run(load())
    for gone in ("doc-0", "doc-1"):
        del docs[gone]
    shards = [
        start_shard(
            index_dir=index_dir,
            redis_url=module_redis,
            shard=s,
            shards=3,
            work_dir=work,
            replica=f"g2-shard-{s}",
            settings={"generation": "g2"},
        )
        for s in range(3)
    ]
    try:
        yield Store(module_redis, index_dir, docs, shards, work)
    finally:
        for shard in shards:
            shard.stop()
        client.close()


def stub(address: str) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(address)
    return channel, index_pb2_grpc.IndexShardServiceStub(channel)


@pytest.mark.slow
def test_g2_shards_follow_their_own_logs_and_answer_searches(store: Store) -> None:
    client = sync_client(store.url)
    for s, shard in enumerate(store.shards):
        channel, shard_stub = stub(shard.address)
        with channel:
            stats = shard_stub.Stats(index_pb2.ShardStatsRequest(), timeout=10)
            mine = [d for d in store.vectors if G2.layout.shard(d) == s]
            assert stats.generation == "g2" and stats.shard == s
            assert stats.vectors == len(mine)  # only g2's log of this shard, deletes applied
            tail = client.xrevrange(G2.log(s), count=1)[0][0].decode()
            assert stats.applied_position == tail
            queries = np.stack([store.vectors[d] for d in mine[:5]])
            reply = shard_stub.Search(
                index_pb2.ShardSearchRequest(shard=s, queries=convert.vectors_to_pb(queries), k=1),
                timeout=10,
            )
            found = convert.answer_from_pb(reply).top
            assert [row[0][0] for row in found.hits()] == mine[:5]
        # registered under g2's keys, not g1's
        assert client.hexists(G2.snapshots(s), f"g2-shard-{s}")
        assert client.hexists(G2.replicas_seen(s), f"g2-shard-{s}")
    assert not client.exists("snap:{0}") and not client.exists("snap:{1}")
    assert client.xlen(log_key(0)) + client.xlen(log_key(1)) == 1  # g1's write, untouched


def test_a_g2_shard_applies_new_writes_of_its_generation(store: Store) -> None:
    async def write() -> dict[int, str]:
        writer = ChangeLogWriter.connect(store.url, BASE, dim=DIM, keys=G2)
        try:
            return await writer.upsert([DocRecord("late", unit(1, 5)[0], text="late")])
        finally:
            await writer.close()

    token = asyncio.run(write())
    (s,) = token
    channel, shard_stub = stub(store.shards[s].address)
    with channel:
        reply = shard_stub.Search(
            index_pb2.ShardSearchRequest(
                shard=s,
                queries=convert.vectors_to_pb(unit(1, 5)),
                k=1,
                consistency=common_pb2.CONSISTENCY_SESSION,
                min_position=token[s],
            ),
            timeout=10,
        )
    assert convert.answer_from_pb(reply).top.hits()[0][0][0] == "late"
    store.vectors["late"] = unit(1, 5)[0]


def test_stats_asked_for_a_position_answers_once_it_is_searchable_in_both_indexes(
    store: Store,
) -> None:
    """``Stats`` with ``applied_at_least`` (what a rollout's switch waits for with the writes
    closed): the replica answers once it applied the position, its text searchable, and
    makes it so at once: this replica refreshes its text index only every 600 s, so an
    answer that waited for the refresh would be the server's DEADLINE_EXCEEDED. A
    position it never reaches is the server's DEADLINE_EXCEEDED (naming what it applied)
    within the call's deadline, or the shard's default one for a call without a deadline;
    a malformed one INVALID_ARGUMENT."""
    shard = start_shard(
        index_dir=store.index_dir,
        redis_url=store.url,
        shard=0,
        shards=3,
        work_dir=store.work,
        replica="g2-shard-0-slow-refresh",
        # a call without a deadline gets this one (as a search without one does)
        settings={"generation": "g2", "text-refresh-s": "600", "default-timeout-s": "1"},
    )
    try:
        doc_id = next(f"refresh-{n}" for n in range(100) if G2.layout.shard(f"refresh-{n}") == 0)

        async def write() -> dict[int, str]:
            writer = ChangeLogWriter.connect(store.url, BASE, dim=DIM, keys=G2)
            try:
                text = "quokkas sunbathe beside the lighthouse"
                return await writer.upsert([DocRecord(doc_id, unit(1, 11)[0], text=text)])
            finally:
                await writer.close()

        token = asyncio.run(write())
        channel, shard_stub = stub(shard.address)
        with channel:
            stats = shard_stub.Stats(
                index_pb2.ShardStatsRequest(applied_at_least=token[0]), timeout=10
            )
            assert compare(stats.applied_position, token[0]) >= 0
            reply = shard_stub.Search(
                index_pb2.ShardSearchRequest(shard=0, texts=["quokkas lighthouse"], sparse_k=3),
                timeout=10,
            )
            sparse = convert.answer_from_pb(reply).sparse
            assert sparse is not None and doc_id in sparse.ids
            store.vectors[doc_id] = unit(1, 11)[0]

            ms = int(token[0].split("-")[0])
            with pytest.raises(grpc.RpcError) as late:
                shard_stub.Stats(
                    index_pb2.ShardStatsRequest(applied_at_least=f"{ms + 3_600_000}-0"),
                    timeout=1.0,
                )
            assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "not yet" in (late.value.details() or "")  # the server's, not the client's
            # no deadline at all: the shard's default bounds the wait (it waited forever);
            # the client sends none and only bounds how long this test waits for the answer
            unbounded = shard_stub.Stats.future(
                index_pb2.ShardStatsRequest(applied_at_least=f"{ms + 3_600_000}-0")
            )
            with pytest.raises(grpc.RpcError) as never:
                unbounded.result(timeout=30)
            assert never.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "not yet" in (never.value.details() or "")
            with pytest.raises(grpc.RpcError) as bad:
                shard_stub.Stats(index_pb2.ShardStatsRequest(applied_at_least="soon"), timeout=5)
            assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        shard.stop()


def test_export_vectors_streams_what_the_replica_holds(store: Store) -> None:
    """Every id of the shard once, its vector the SQ8 round trip of the upserted one (within
    half a quantization step of it), and the replica's applied position; several chunks
    when asked for small ones."""
    trained = TrainedIndex.load(store.index_dir)
    vmin, vdiff = np.split(faiss.vector_to_array(trained.sq.trained), 2)  # per dimension
    client = sync_client(store.url)

    async def export(address: str, batch: int) -> tuple[list[str], np.ndarray, set[str], int]:
        ids: list[str] = []
        rows: list[np.ndarray] = []
        seen: set[str] = set()
        chunks = 0
        async for chunk_ids, vectors, position in export_vectors(address, batch=batch):
            ids += chunk_ids
            rows.append(vectors)
            seen.add(position)
            chunks += 1
        return ids, np.concatenate(rows), seen, chunks

    for s, shard in enumerate(store.shards):
        ids, vectors, seen, chunks = asyncio.run(export(shard.address, 40))
        mine = {d for d in store.vectors if G2.layout.shard(d) == s}
        assert len(ids) == len(set(ids)) and set(ids) == mine
        assert chunks == -(-len(mine) // 40) and vectors.shape == (len(mine), DIM)
        upserted = np.stack([store.vectors[d] for d in ids])
        round_trip = trained.refine.sa_decode(trained.refine.sa_encode(upserted))
        assert np.array_equal(vectors, round_trip)
        in_range = np.clip(upserted, vmin, vmin + vdiff)  # SQ8 clips to its trained range
        assert (np.abs(vectors - in_range) <= vdiff / 255 / 2 + 1e-6).all()
        assert not np.array_equal(vectors, upserted)  # decoded codes, not the float32 ones
        assert seen == {client.xrevrange(G2.log(s), count=1)[0][0].decode()}


def test_export_vectors_refuses_chunks_past_its_limits(store: Store) -> None:
    async def run(batch: int) -> None:
        async for _ in export_vectors(store.shards[0].address, batch=batch, timeout=10):
            pass

    with pytest.raises(InvalidArgument, match="batch: 70000 vectors of dimension 32"):
        asyncio.run(run(70_000))


def test_export_vectors_of_a_missing_replica_is_unavailable() -> None:
    async def run() -> None:
        async for _ in export_vectors(f"127.0.0.1:{free_port()}", timeout=2):
            pass

    with pytest.raises(Unavailable):
        asyncio.run(run())


def test_a_replica_of_another_generation_does_not_seed_a_peer(store: Store) -> None:
    channel, shard_stub = stub(store.shards[0].address)
    with channel:
        with pytest.raises(grpc.RpcError) as refused:
            next(
                iter(
                    shard_stub.FetchSnapshot(
                        index_pb2.FetchSnapshotRequest(shard=0, replica="x"), timeout=10
                    )
                )
            )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "generation g2, not g1" in (refused.value.details() or "")


@pytest.mark.parametrize(
    ("generation", "shards", "message"),
    [
        ("g7", 3, "generation g7 is not in the registry"),
        ("g2", 4, "generation g2 has 3 shards, this service is configured for 4"),
        ("g1", 3, "written for 2 shards, this service is configured for 3"),
    ],
)
def test_a_shard_of_an_unknown_generation_or_shard_count_refuses_to_start(
    store: Store, generation: str, shards: int, message: str
) -> None:
    settings = ShardSettings(
        shard=0,
        shards=shards,
        generation=generation,
        redis_url=store.url,
        index_dir=str(store.index_dir),
        snapshot_dir=str(store.work / f"refused-{generation}-{shards}"),
        text_index=False,
    )
    replica = ShardReplica(settings)

    async def start() -> None:
        try:
            replica.start(asyncio.get_running_loop())
        finally:
            await replica.close()

    with pytest.raises(FailedPrecondition, match=message):
        asyncio.run(start())


def test_the_generation_setting_takes_generation_names_only() -> None:
    with pytest.raises(ValueError, match="is not a generation name"):
        ShardSettings(shard=0, shards=1, generation="blue", index_dir="x", snapshot_dir="y")


def test_a_replica_refuses_a_snapshot_folder_of_another_generation(store: Store) -> None:
    """g2's first replica wrote its snapshot folder's generation; a g1 replica pointed at
    it (a copy-paste of the settings) refuses to load positions of another log."""
    folder = store.shards[0].snapshot_dir
    assert (folder / "GENERATION").read_text().strip() == "g2"
    settings = ShardSettings(
        shard=0,
        shards=BASE,
        redis_url=store.url,
        index_dir=str(store.index_dir),
        snapshot_dir=str(folder),
        text_index=False,
    )
    with pytest.raises(FailedPrecondition, match="snapshots of generation g2, this replica"):
        ShardReplica(settings)


def test_the_shard_metrics_say_which_generation() -> None:
    from prometheus_client import CollectorRegistry

    from services.index.server.metrics import ShardMetrics

    registry = CollectorRegistry()
    ShardMetrics.create(registry, 2, "g2-shard-2", "g2")
    labels = {"shard": "2", "replica": "g2-shard-2", "generation": "g2"}
    assert registry.get_sample_value("index_generation_info", labels) == 1.0
