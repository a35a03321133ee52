"""The store clients of a generation (issue #24, docs/generations.md) on a real Redis and a
real Redis Cluster: the writer writes to its generation's logs and its layout's documents,
only while the writer gate of every shard it touches names its generation; a refused
batch writes nothing; the readers read a generation's documents, tails and logs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from services.common.errors import GenerationMoved
from services.generations.registry import Registry
from services.index.changelog import LogReader, decode_entry
from services.index.client.connection import StoreConnection
from services.index.client.documents import DocumentReader
from services.index.client.tails import LogTailReader
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.changes import Delete, Upsert
from services.index.keys import CLOSED, GenerationKeys, Layout, log_key
from services.process.redis_client import sync_client

DIM = 8
BASE = Layout(2, base=2)
G1, G2 = GenerationKeys("g1", BASE), GenerationKeys("g2", BASE)
G3 = GenerationKeys("g3", Layout(3, base=2))  # a reshard: 3 shards over the base 2


def rec(doc_id: str, seed: int = 0) -> DocRecord:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return DocRecord(doc_id, v, title=f"t {doc_id}", text=f"text {doc_id}", metadata={"k": "v"})


def ids_on(layout: Layout, shard: int, n: int, prefix: str = "d") -> list[str]:
    """``n`` document ids whose shard in ``layout`` is ``shard``."""
    out: list[str] = []
    i = 0
    while len(out) < n:
        if layout.shard(f"{prefix}{i}") == shard:
            out.append(f"{prefix}{i}")
        i += 1
    return out


def state(client: Any) -> dict[str, Any]:
    """Every key of the store with its content (hashes, strings, streams)."""
    out: dict[str, Any] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        if kind == "hash":
            out[key.decode()] = client.hgetall(key)
        elif kind == "string":
            out[key.decode()] = client.get(key)
        elif kind == "stream":
            out[key.decode()] = client.xrange(key)
        else:
            out[key.decode()] = kind
    return out


@pytest.fixture
def client(any_redis_url: str) -> Iterator[Any]:
    c = sync_client(any_redis_url)
    yield c
    c.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _write(url: str, keys: GenerationKeys | None, records: list[DocRecord]) -> Any:
    writer = ChangeLogWriter.connect(url, num_shards=2, dim=DIM, keys=keys)
    try:
        return await writer.upsert(records)
    finally:
        await writer.close()


async def _delete(url: str, keys: GenerationKeys | None, ids: list[str]) -> Any:
    writer = ChangeLogWriter.connect(url, num_shards=2, dim=DIM, keys=keys)
    try:
        return await writer.delete(ids)
    finally:
        await writer.close()


def test_a_writer_writes_to_g1_of_the_base_layout_by_default(
    any_redis_url: str, client: Any
) -> None:
    token = run(_write(any_redis_url, None, [rec("a"), rec("b", 1), rec("c", 2)]))
    for shard, position in token.items():
        assert client.xrange(log_key(shard))[-1][0].decode() == position
        assert client.xrange(log_key(shard)) == client.xrange(G1.log(shard))
    assert client.hget(BASE.doc("a"), "title") == b"t a"
    assert not any(k.endswith(b":g1") for k in client.scan_iter())  # no generation suffix
    # the same writer with g1's keys named is the same writer
    again = run(_write(any_redis_url, G1, [rec("a", 3)]))
    assert client.hget(BASE.doc("a"), "ver") == b"2" and set(again) == {BASE.shard("a")}


def test_a_gate_naming_g2_refuses_a_g1_writer_and_takes_a_g2_writer(
    any_redis_url: str, client: Any
) -> None:
    run(_write(any_redis_url, None, [rec("a"), rec("b", 1)]))
    Registry(client).set_gates(BASE, "g2")
    before = state(client)

    with pytest.raises(GenerationMoved) as refused:
        run(_write(any_redis_url, G1, [rec("a", 5), rec("new", 6)]))
    assert refused.value.gate == "g2" and "generation g2" in refused.value.message
    with pytest.raises(GenerationMoved) as refused_delete:
        run(_delete(any_redis_url, None, ["a", "b"]))
    assert refused_delete.value.gate == "g2"
    assert state(client) == before  # documents, versions and logs untouched

    token = run(_write(any_redis_url, G2, [rec("a", 7), rec("c", 8)]))
    for shard, position in token.items():
        entries = client.xrange(G2.log(shard))  # log:{s}:g2
        assert G2.log(shard) == f"log:{{{shard}}}:g2"
        assert entries[-1][0].decode() == position
    # the documents are the layout's, shared by g1 and g2: one version counter
    assert client.hget(BASE.doc("a"), "ver") == b"2"
    entries = LogReader(client, BASE.shard("a"), G2).read("0-0", 10, 0)
    (change,) = [c for _, f in entries for c in decode_entry(f) if c.doc_id == "a"]
    assert isinstance(change, Upsert) and change.version == 2
    # g1's log did not get the g2 write
    g1_ids = [
        c.doc_id
        for _, f in LogReader(client, BASE.shard("a")).read("0-0", 10, 0)
        for c in decode_entry(f)
    ]
    assert g1_ids.count("a") == 1

    token, deleted, missing = run(_delete(any_redis_url, G2, ["c", "nope"]))
    assert deleted == ["c"] and missing == ["nope"]
    (shard,) = token
    last = client.xrange(G2.log(shard))[-1][1]
    assert decode_entry(last) == [Delete("c", 2)]


def test_a_writer_that_waits_for_replicas_is_refused_by_its_gate_too(
    any_redis_url: str, client: Any
) -> None:
    """With ``wait_replicas`` the script and WAIT go in one pipeline: its refusal is still
    GenerationMoved (not Unavailable, not "reached 0 of 1 replicas")."""
    Registry(client).set_gates(BASE, "g2")

    async def run_both() -> None:
        writer = ChangeLogWriter.connect(
            any_redis_url, 2, dim=DIM, wait_replicas=1, wait_timeout_ms=100
        )
        try:
            with pytest.raises(GenerationMoved) as refused:
                await writer.upsert([rec("a")])
            assert refused.value.gate == "g2"
            with pytest.raises(GenerationMoved):
                await writer.delete(["a"])
        finally:
            await writer.close()

    before = state(client)
    run(run_both())
    assert state(client) == before


def test_a_closed_gate_refuses_every_writer(any_redis_url: str, client: Any) -> None:
    run(_write(any_redis_url, None, [rec("a")]))
    shard = BASE.shard("a")
    client.set(BASE.gate(shard), CLOSED)
    before = state(client)
    for keys in (G1, G2):
        with pytest.raises(GenerationMoved) as refused:
            run(_write(any_redis_url, keys, [rec("a", 1)]))
        assert refused.value.gate == CLOSED and "switch drains" in refused.value.message
        with pytest.raises(GenerationMoved):
            run(_delete(any_redis_url, keys, ["a"]))
    assert state(client) == before


def test_a_batch_over_an_open_and_a_moved_shard_writes_nothing(redis_url: str) -> None:
    """On one Redis a batch is one script: one refusing gate refuses the whole of it (on
    a cluster each shard's part is a script of its own, see ChangeLogWriter)."""
    client = sync_client(redis_url)
    open_ids, moved_ids = ids_on(BASE, 0, 3), ids_on(BASE, 1, 3)
    run(_write(redis_url, None, [rec(i) for i in open_ids + moved_ids]))
    client.set(BASE.gate(1), "g2")
    before = state(client)
    with pytest.raises(GenerationMoved):
        run(_write(redis_url, None, [rec(i, 9) for i in open_ids + moved_ids]))
    with pytest.raises(GenerationMoved):
        run(_delete(redis_url, None, open_ids + moved_ids))
    assert state(client) == before
    # shard 0's gate alone still takes g1's writes
    assert set(run(_write(redis_url, None, [rec(open_ids[0], 9)]))) == {0}


def test_another_layout_is_closed_until_its_gates_name_a_generation(
    any_redis_url: str, client: Any
) -> None:
    """A reshard's layout (3 shards over a base of 2): its own documents ``doc:{3.s}:``,
    its generation's logs ``log:{3.s}:g3``; an absent gate there is closed."""
    with pytest.raises(GenerationMoved) as refused:
        run(_write(any_redis_url, G3, [rec("x")]))
    assert refused.value.gate == CLOSED
    assert state(client) == {}

    Registry(client).set_gates(G3.layout, "g3")
    records = [rec(f"x{i}", i) for i in range(12)]
    token = run(_write(any_redis_url, G3, records))
    assert set(token) == {G3.layout.shard(r.doc_id) for r in records}
    for shard, position in token.items():
        assert client.xrange(f"log:{{3.{shard}}}:g3")[-1][0].decode() == position
    assert client.hget(f"doc:{{3.{G3.layout.shard('x0')}}}:x0", "title") == b"t x0"
    assert not client.exists(BASE.doc("x0"))  # the base layout's documents are not written

    async def read() -> None:
        connection = StoreConnection(any_redis_url, num_shards=2)
        try:
            doc = await DocumentReader(connection, G3.layout).get("x0")
            assert doc is not None and doc.title == "t x0" and doc.version == 1
            assert await DocumentReader(connection).get("x0") is None  # base layout
            assert await LogTailReader(connection, G3).tail() == token
            assert await LogTailReader(connection).tail() == {}  # g1's logs are empty
        finally:
            await connection.close()

    run(read())


def test_the_log_reader_of_a_generation_registers_and_trims_its_own_log(
    any_redis_url: str, client: Any
) -> None:
    ids = [client.xadd(G2.log(0), {"op": "d", "ids": "[]"}).decode() for _ in range(5)]
    client.xadd(log_key(0), {"op": "d", "ids": "[]"})
    reader = LogReader(client, 0, G2)
    assert reader.key == "log:{0}:g2" and reader.tail() == ids[-1]
    reader.register_snapshot("r0", ids[2])
    assert client.hget(G2.snapshots(0), "r0") == ids[2].encode()
    assert client.hexists(G2.replicas_seen(0), "r0")
    assert not client.exists("snap:{0}")  # g1's registrations are g1's
    assert reader.trim_below_snapshots() == ids[2]
    assert [e[0].decode() for e in client.xrange(G2.log(0))] == ids[2:]
    assert client.xlen(log_key(0)) == 1  # g1's log is not trimmed by g2's replicas
