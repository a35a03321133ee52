"""Writes acknowledged only once a Redis replica has them (``WAIT``), and what that buys:
a primary of a real Redis Cluster killed (``kill -9``) during writes loses none of them.

The cluster of the failover test is this module's own (it kills a primary), not the
session's shared one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.common.errors import Unavailable
from services.index.changelog import LogReader, decode_entry
from services.index.client.connection import StoreConnection
from services.index.client.documents import DocumentReader
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.changes import Upsert
from services.index.keys import log_key
from services.process.redis_client import sync_client
from tests.support.processes import RedisServer, await_until, wait_until
from tests.support.redis_cluster import RedisCluster, run_redis_cluster
from tests.support.redis_replica import run_redis_replica

SHARDS = 3
DIM = 8


def records(prefix: str, n: int, seed: int) -> list[DocRecord]:
    vectors = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return [
        DocRecord(f"{prefix}-{j}", vectors[j], title=prefix, text=f"text {prefix}-{j}")
        for j in range(n)
    ]


@pytest.fixture(scope="module")
def failover_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    with run_redis_cluster(tmp_path_factory.mktemp("failover-cluster")) as cluster:
        yield cluster


def test_without_a_replica_a_write_that_waits_for_one_is_unavailable(redis_url: str) -> None:
    """WAIT really counts replicas: a lone Redis never acknowledges one, so the write is
    refused (UNAVAILABLE, safe to retry) instead of being acknowledged as replicated."""

    async def run() -> None:
        writer = ChangeLogWriter.connect(
            redis_url, SHARDS, dim=DIM, wait_replicas=1, wait_timeout_ms=100
        )
        try:
            with pytest.raises(Unavailable, match="reached 0 of 1 replicas"):
                await writer.upsert(records("lone", 4, 0))
            with pytest.raises(Unavailable, match="reached 0 of 1 replicas"):
                await writer.delete(["lone-0"])
        finally:
            await writer.close()

    asyncio.run(run())


@pytest.mark.slow
def test_with_a_replica_a_write_waits_for_it_and_the_replica_has_it(
    redis_server: RedisServer, redis_url: str, tmp_path: Path
) -> None:
    with run_redis_replica(redis_server.port, tmp_path / "replica") as replica:
        del replica

        async def run() -> None:
            writer = ChangeLogWriter.connect(redis_url, SHARDS, dim=DIM, wait_replicas=1)
            try:
                token = await writer.upsert(records("waited", 6, 1))
                _, deleted, _ = await writer.delete(["waited-0"])
                assert deleted == ["waited-0"] and token
                assert (await DocumentReader(writer.connection).get("waited-1")) is not None
            finally:
                await writer.close()

        asyncio.run(run())


@pytest.mark.slow  # a cluster of its own, a failover and a node's return: ~30 s
def test_a_primary_killed_during_writes_loses_no_acknowledged_write(
    failover_cluster: RedisCluster,
) -> None:
    """kill -9 of the primary that holds shard 0 while 4 writers upsert and delete with
    ``--redis-wait-replicas 1``; its replica is promoted, the killed node comes back as
    its replica, writes go on, and every acknowledged upsert is then readable (document
    and log entry) and every acknowledged delete stays deleted."""
    cluster = failover_cluster
    victim = cluster.primary_of(log_key(0))
    acked: dict[str, DocRecord] = {}
    deleted: set[str] = set()
    undecided: set[str] = set()  # a delete that failed: it may have happened or not
    refused = 0
    acked_after_promotion = 0
    killed_at: float | None = None
    promoted_at: float | None = None

    async def run() -> None:
        nonlocal refused, killed_at, promoted_at
        connection = StoreConnection(cluster.url, SHARDS, read_retry_s=20)
        writer = ChangeLogWriter(connection, dim=DIM, wait_replicas=1, wait_timeout_ms=2000)

        async def write(worker: int) -> None:
            nonlocal refused, acked_after_promotion
            n = 0
            while promoted_at is None or time.monotonic() - promoted_at < 1.5:
                batch = records(f"w{worker}-{n}", 6, worker * 10_000 + n)
                try:
                    await writer.upsert(batch)
                    acked.update({r.doc_id: r for r in batch})
                    if promoted_at is not None:
                        acked_after_promotion += len(batch)
                    if n % 3 == 2 and f"w{worker}-{n - 2}-0" in acked:
                        gone = [f"w{worker}-{n - 2}-{j}" for j in (0, 3)]
                        undecided.update(gone)
                        _, really, _ = await writer.delete(gone)
                        deleted.update(really)
                        undecided.difference_update(gone)
                except Unavailable:
                    refused += 1
                    await asyncio.sleep(0.05)
                n += 1

        async def fail_over() -> None:
            nonlocal killed_at, promoted_at
            await await_until(lambda: len(acked) >= 200, "200 acknowledged upserts", 120, 0.01)
            victim.kill()
            killed_at = time.monotonic()
            await asyncio.to_thread(
                wait_until,
                lambda: cluster.healthy() and cluster.primary_of(log_key(0)) is not victim,
                "a replica promoted in the killed primary's place",
                timeout=30,
            )
            # The promoted primary has no replica left, so WAIT 1 refuses shard 0's
            # writes until the killed node is back (as a replica of the new primary).
            await asyncio.to_thread(victim.start)
            await asyncio.to_thread(
                wait_until, cluster.healthy, "the killed node back as a replica", timeout=30
            )
            assert cluster.role(victim) == "slave"
            promoted_at = time.monotonic()

        try:
            await asyncio.wait_for(
                asyncio.gather(fail_over(), *(write(w) for w in range(4))), timeout=90
            )
            alive = sorted(set(acked) - deleted - undecided)
            reader = DocumentReader(connection)
            docs = await reader.get_many(alive)
            missing = [i for i, d in zip(alive, docs, strict=True) if d is None]
            assert not missing, f"{len(missing)} acknowledged upserts lost, e.g. {missing[:5]}"
            for doc_id, doc in zip(alive, docs, strict=True):
                assert doc is not None and doc.text == acked[doc_id].text
            assert await reader.get_many(sorted(deleted)) == [None] * len(deleted)
        finally:
            await connection.close()

    asyncio.run(run())
    assert killed_at is not None and promoted_at is not None
    assert refused > 0, "no write met the failover: the test did not test it"
    assert acked_after_promotion > 0, "writes did not resume on the promoted replica"

    # the logs agree: every acknowledged upsert is in its shard's log
    client: Any = sync_client(cluster.url)
    logged: set[str] = set()
    for shard in range(SHARDS):
        for _, fields in LogReader(client, shard).read("0-0", 1_000_000, 0):
            logged |= {c.doc_id for c in decode_entry(fields) if isinstance(c, Upsert)}
    client.close()
    assert set(acked) <= logged


@pytest.mark.slow
def test_a_cluster_with_tls_and_auth_is_reached_through_a_rediss_cluster_url(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """What a managed cluster looks like (TLS only, an AUTH token on every node): the
    writer with WAIT and the layout check reach it through
    ``rediss+cluster://:token@...?ssl_ca_certs=...``; without the token, or without the
    CA that signed the nodes' certificate, a read is UNAVAILABLE and says why."""
    from services.index.layout import check_layout_at
    from services.stack.certs import make_certs

    work = tmp_path_factory.mktemp("tls-auth-cluster")
    certs = make_certs(work / "certs").dir
    with run_redis_cluster(work / "nodes", password="s3cret-token", tls=certs) as c:
        assert c.url.startswith("rediss+cluster://:s3cret-token@")
        check_layout_at(c.url, SHARDS, wait_s=0)

        async def run() -> None:
            writer = ChangeLogWriter.connect(c.url, SHARDS, dim=DIM, wait_replicas=1)
            anonymous = StoreConnection(c.url.replace(":s3cret-token@", ""), SHARDS)
            untrusting = StoreConnection(c.url.split("/?")[0], SHARDS, read_retry_s=0)
            try:
                await writer.upsert(records("tls", 9, 2))
                doc = await DocumentReader(writer.connection).get("tls-4")
                assert doc is not None and doc.text == "text tls-4"
                with pytest.raises(Unavailable, match=r"(?i)auth"):
                    await DocumentReader(anonymous).get("tls-4")
                with pytest.raises(Unavailable, match=r"(?i)certificate"):
                    await DocumentReader(untrusting).get("tls-4")
            finally:
                for closing in (writer, anonymous, untrusting):
                    await closing.close()

        asyncio.run(run())
