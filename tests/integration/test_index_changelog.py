"""The change log on a real Redis: atomic writes, versions, tokens, the shard reader."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.index.changelog import LogReader, decode_entry
from services.index.client.connection import StoreConnection
from services.index.client.documents import DocumentReader
from services.index.client.tails import LogTailReader
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.changes import Delete, Upsert
from services.index.core.ids import shard_of
from services.index.keys import log_key, replicas_seen_key, snapshot_positions_key
from services.process.redis_client import sync_client

SNAP_0, SEEN_0 = snapshot_positions_key(0), replicas_seen_key(0)


def rec(doc_id: str, seed: int = 0, dim: int = 8, **meta: str) -> DocRecord:
    v = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    return DocRecord(doc_id, v, title=f"t {doc_id}", text=f"text {doc_id}", metadata=meta)


def test_upsert_stores_docs_and_logs_them_per_shard(any_redis_url: str) -> None:
    async def run() -> None:
        # the writer and both readers on one connection, as the gateway wires them
        connection = StoreConnection(any_redis_url, num_shards=3)
        writer = ChangeLogWriter(connection, dim=8)
        docs, tails = DocumentReader(connection), LogTailReader(connection)
        try:
            records = [rec(f"d{i}", i, lang="en") for i in range(20)]
            token = await writer.upsert(records)
            shards = {shard_of(r.doc_id, 3) for r in records}
            assert set(token) == shards
            stored = await docs.get("d3")
            assert (
                stored is not None and stored.title == "t d3" and stored.metadata == {"lang": "en"}
            )
            assert stored.version == 1
            assert await docs.get("missing") is None
            assert await tails.tail() == token

            sync = sync_client(any_redis_url)
            seen = {}
            for shard in shards:
                reader = LogReader(sync, shard)
                entries = reader.read("0-0", 100, 0)
                assert [p for p, _ in entries] == [token[shard]]
                for change in decode_entry(entries[0][1]):
                    assert isinstance(change, Upsert) and shard_of(change.doc_id, 3) == shard
                    seen[change.doc_id] = change
            assert set(seen) == {r.doc_id for r in records}
            for r in records:
                assert np.array_equal(seen[r.doc_id].vector, r.vector)
                assert seen[r.doc_id].tags == {"lang": "en"} and seen[r.doc_id].version == 1
        finally:
            await connection.close()

    asyncio.run(run())


def test_versions_are_monotonic_per_doc_across_deletes(any_redis_url: str) -> None:
    async def run() -> None:
        writer = ChangeLogWriter.connect(any_redis_url, num_shards=2)
        docs = DocumentReader(writer.connection)
        try:
            await writer.upsert([rec("a")])
            await writer.upsert([rec("a", 1)])
            token, deleted, missing = await writer.delete(["a", "nope"])
            assert deleted == ["a"] and missing == ["nope"]
            assert list(token) == [shard_of("a", 2)]
            assert await docs.get("a") is None
            await writer.upsert([rec("a", 2)])
            doc = await docs.get("a")
            assert doc is not None and doc.version == 4  # 2 upserts, 1 delete, 1 upsert

            sync = sync_client(any_redis_url)
            entries = LogReader(sync, shard_of("a", 2)).read("0-0", 100, 0)
            changes = [c for _, f in entries for c in decode_entry(f)]
            assert [type(c) for c in changes] == [Upsert, Upsert, Delete, Upsert]
            assert [c.version for c in changes] == [1, 2, 3, 4]

            # deleting only missing ids logs nothing
            token, deleted, missing = await writer.delete(["nope"])
            assert token == {} and deleted == [] and missing == ["nope"]
        finally:
            await writer.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([rec("a"), rec("a", 1)], "twice"),
        ([rec("a"), rec("b", dim=9)], "dimension"),
        ([DocRecord("a", np.full(8, np.nan, np.float32))], "NaN"),
        ([DocRecord("a", np.full(8, np.inf, np.float32))], "NaN"),
        ([DocRecord("", np.ones(8, np.float32))], "empty"),
        ([], "1..1024"),
    ],
)
def test_invalid_upserts_write_nothing(
    any_redis_url: str, records: list[DocRecord], message: str
) -> None:
    async def run() -> None:
        writer = ChangeLogWriter.connect(any_redis_url, num_shards=2, dim=8)
        try:
            with pytest.raises(InvalidArgument, match=message):
                await writer.upsert(records)
            with pytest.raises(InvalidArgument, match="twice"):
                await writer.delete(["x", "x"])
        finally:
            await writer.close()

    asyncio.run(run())
    sync = sync_client(any_redis_url)
    assert sync.dbsize() == 0


def test_trim_below_the_oldest_registered_snapshot(any_redis_url: str) -> None:
    sync: Any = sync_client(any_redis_url)
    ids = [sync.xadd(log_key(0), {"op": "d", "ids": "[]"}).decode() for _ in range(10)]
    reader = LogReader(sync, 0)
    assert reader.trim_below_snapshots() is None  # nobody registered: keep everything
    reader.register_snapshot("r0", ids[7])
    reader.register_snapshot("r1", "0-0")  # a replica without snapshot holds the log
    assert reader.trim_below_snapshots() is None and sync.xlen(log_key(0)) == 10
    reader.register_snapshot("r1", ids[3])  # the slowest replica decides
    assert reader.trim_below_snapshots() == ids[3]
    assert [e[0].decode() for e in sync.xrange(log_key(0))] == ids[3:]
    assert not reader.trimmed_past(ids[3]) and not reader.trimmed_past(ids[7])
    assert not LogReader(sync, 5).trimmed_past("0-0")  # no stream at all
    assert reader.trimmed_past("0-0") and reader.trimmed_past(ids[1])


def test_a_replica_unseen_too_long_stops_holding_the_log_back(any_redis_url: str) -> None:
    """A removed replica (scaled down, renamed) would hold trimming back forever: after
    ``stale_after_s`` without a heartbeat its registration goes, a live one stays."""
    sync: Any = sync_client(any_redis_url)
    ids = [sync.xadd(log_key(0), {"op": "d", "ids": "[]"}).decode() for _ in range(10)]
    reader = LogReader(sync, 0)
    now = 1_000_000.0
    reader.register_snapshot("gone", ids[1], now=now - 7200)  # last seen 2 h ago
    reader.register_snapshot("live", ids[6], now=now - 10)
    sync.hset(SNAP_0, "legacy", ids[2])  # registered without a heartbeat: counts as live
    assert reader.trim_below_snapshots(stale_after_s=3600, now=now) == ids[2]
    assert {r.decode() for r in sync.hkeys(SNAP_0)} == {"live", "legacy"}
    assert {r.decode() for r in sync.hkeys(SEEN_0)} == {"live"}
    sync.hdel(SNAP_0, "legacy")
    # the heartbeat keeps an idle replica: seen 10 s ago is not stale
    assert reader.trim_below_snapshots(stale_after_s=3600, now=now) == ids[6]
    assert [e[0].decode() for e in sync.xrange(log_key(0))] == ids[6:]
    # without a threshold nothing expires
    reader.register_snapshot("old", ids[6], now=0.0)
    assert reader.trim_below_snapshots() == ids[6] and sync.hexists(SNAP_0, "old")
    # the removed replica, back after all, finds the log trimmed past its snapshot
    assert reader.trimmed_past(ids[1])
