"""A store written with key layout 1 (``doc:<id>``, ``log:<s>``: before Redis Cluster) is
refused by the services with the command to run, and ``gtr-retrieval redis migrate``
rewrites it: resumable after an interruption, idempotent, nothing lost or changed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.cli.main import main as cli
from services.common.errors import FailedPrecondition
from services.index.changelog import LogReader
from services.index.client.documents import DocumentReader
from services.index.client.writer import _DELETE, _UPSERT, ChangeLogWriter, DocRecord
from services.index.core.ids import shard_of
from services.index.keys import DocKeys, log_key, replicas_seen_key, snapshot_positions_key
from services.index.layout import check_layout, read_layout
from services.index.migrate import PENDING_IDS, MigrationReport, migrate
from services.process.redis_client import sync_client
from services.stack import components
from tests.support.shards import scifact_vectors, shared_test_index, start_shard

SHARDS = 3
DIM = 8


def v1_write(
    client: Any,
    script: str,
    ids: list[str],
    per_doc: list[list[Any]],
    head: list[Any],
    after: tuple[Any, ...] = (),
) -> None:
    """Run the writer's own Lua script on layout-1 keys: what the old writer stored.
    ``after``: the script's arguments after the generation and the absent gate."""
    of = [shard_of(i, SHARDS) for i in ids]
    shards = sorted(set(of))
    slot = {s: n + 1 for n, s in enumerate(shards)}
    keys = [f"doc:{i}" for i in ids] + [f"ver:{i}" for i in ids] + [f"log:{s}" for s in shards]
    keys += [f"wgen:{s}" for s in shards]  # writer gates (absent: open to g1), never written
    args: list[Any] = [*head, "g1", "g1", *after]  # the writer's generation, an absent gate
    for i, extra in enumerate(per_doc):
        args += [str(slot[of[i]]), ids[i], *extra]
    client.eval(script, len(keys), *keys, *args)


def v1_upsert(client: Any, ids: list[str], seed: int) -> None:
    rng = np.random.default_rng(seed)
    per_doc = [
        [
            f"title {i}",
            f"text {i} {seed}",
            '{"lang": "en"}',
            rng.standard_normal(DIM).astype("<f4").tobytes(),
            b"",  # no rollout target's vector (the dual write)
        ]
        for i in ids
    ]
    # no rollout target's encoder nor dimension
    v1_write(client, _UPSERT, ids, per_doc, [str(len(ids)), str(DIM)], ("", "0"))


def v1_delete(client: Any, ids: list[str]) -> None:
    v1_write(client, _DELETE, ids, [[] for _ in ids], [str(len(ids))])


def build_v1_store(client: Any) -> list[str]:
    """120 documents in 6 batches, 20 upserted again, 10 deleted, replicas registered,
    shard 0's log trimmed: every kind of layout-1 key, with history."""
    ids = [f"doc-{n}" for n in range(120)] + ["{1}:looks-tagged"]
    for b in range(0, len(ids), 20):
        v1_upsert(client, ids[b : b + 20], seed=b)
    v1_upsert(client, ids[:20], seed=999)
    v1_delete(client, ids[100:110])
    for s in range(SHARDS):
        entries = client.xrange(f"log:{s}")
        client.hset(f"snap:{s}", "shard-r0", entries[1][0])
        client.hset(f"snapseen:{s}", "shard-r0", "1000.0")
    floor = client.xrange("log:0")[2][0]
    client.xtrim("log:0", minid=floor, approximate=False)
    return ids


def test_the_services_refuse_a_layout_1_store_and_name_the_command(
    redis_url: str, scifact_dir: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    client: Any = sync_client(redis_url)
    build_v1_store(client)
    with pytest.raises(FailedPrecondition, match="gtr-retrieval redis migrate"):
        check_layout(client, SHARDS)  # what the gateway runs at start
    index_dir = shared_test_index(tmp_path_factory.getbasetemp(), scifact_vectors(scifact_dir))
    with pytest.raises(RuntimeError, match="gtr-retrieval redis migrate"):
        start_shard(
            index_dir=index_dir,
            redis_url=redis_url,
            shard=0,
            shards=SHARDS,
            work_dir=tmp_path,
            timeout=60,
        )
    client.close()


class Interrupted(Exception):
    pass


def test_migration_resumes_after_an_interruption_and_changes_nothing_but_names(
    redis_url: str,
) -> None:
    client: Any = sync_client(redis_url)
    ids = build_v1_store(client)
    docs = {i: client.hgetall(f"doc:{i}") for i in ids}
    versions = {i: client.get(f"ver:{i}") for i in ids}
    logs = {s: client.xrange(f"log:{s}") for s in range(SHARDS)}
    infos = {s: client.xinfo_stream(f"log:{s}") for s in range(SHARDS)}
    snaps = {s: client.hgetall(f"snap:{s}") for s in range(SHARDS)}
    trimmed_away = "0-1"  # older than shard 0's first kept entry
    assert LogReader(client, 0).key == log_key(0)

    with pytest.raises(FailedPrecondition, match="log of shard 2"):
        migrate(client, 2)  # the store was written with 3 shards

    def stop_after_first_batch(report: MigrationReport) -> None:
        raise Interrupted

    with pytest.raises(Interrupted):
        migrate(client, SHARDS, batch=25, progress=stop_after_first_batch)
    with pytest.raises(FailedPrecondition, match="did not finish"):
        check_layout(client, SHARDS)
    # a crash between a RESTORE and its DEL: the new key exists, the old one too
    pending = [m.decode() for m in client.smembers(PENDING_IDS)]
    half = next(i for i in pending if client.exists(f"doc:{i}"))
    new_key = DocKeys(SHARDS).doc(half)
    client.restore(new_key, 0, client.dump(f"doc:{half}"), replace=True)

    assert (
        cli(["redis", "migrate", "--redis-url", redis_url, "--shards", "3", "--batch", "25"]) == 0
    )
    check_layout(client, SHARDS)
    assert cli(["redis", "layout", "--redis-url", redis_url, "--shards", "3"]) == 0
    assert not client.exists(PENDING_IDS)
    keys = {k.decode() for k in client.scan_iter(count=1000)}
    assert not [k for k in keys if k.split(":")[0] in ("doc", "ver", "log") and ":{" not in k]
    assert not client.exists("doc:{1}:looks-tagged")  # an id that looks like a new key

    doc_keys = DocKeys(SHARDS)
    for i in ids:
        assert client.hgetall(doc_keys.doc(i)) == docs[i]
        assert client.get(doc_keys.version(i)) == versions[i]
    for s in range(SHARDS):
        assert client.xrange(log_key(s)) == logs[s]
        info = client.xinfo_stream(log_key(s))
        assert info["entries-added"] == infos[s]["entries-added"]
        assert info["last-generated-id"] == infos[s]["last-generated-id"]
        assert client.hgetall(snapshot_positions_key(s)) == snaps[s]
        assert client.hexists(replicas_seen_key(s), "shard-r0")
    assert LogReader(client, 0).trimmed_past(trimmed_away)  # the trim is remembered
    assert not LogReader(client, 1).trimmed_past("0-0")

    async def read_and_write() -> None:
        writer = ChangeLogWriter.connect(redis_url, SHARDS, dim=DIM)
        reader = DocumentReader(writer.connection)
        try:
            got = await reader.get_many(ids)
            assert [d is None for d in got] == [100 <= n < 110 for n in range(len(ids))]
            before = int(versions["doc-0"] or 0)
            await writer.upsert([DocRecord("doc-0", np.ones(DIM, np.float32))])
            doc = await reader.get("doc-0")
            assert doc is not None and doc.version == before + 1
        finally:
            await writer.close()

    asyncio.run(read_and_write())
    report = migrate(client, SHARDS)
    assert report.already and report.keys_moved == 0
    client.close()


def test_the_local_stack_migrates_its_own_redis(redis_url: str) -> None:
    """``gtr-retrieval up`` on a run directory of layout 1 migrates before it starts
    anything that reads the store (and says so); on a current store it does nothing."""
    client: Any = sync_client(redis_url)
    ids = build_v1_store(client)
    said: list[str] = []
    components.migrate_redis_if_needed(redis_url, SHARDS, said.append)
    check_layout(client, SHARDS)
    assert client.hgetall(DocKeys(SHARDS).doc(ids[0]))
    assert len(said) == 2 and "migrated 121 documents" in said[1]
    components.migrate_redis_if_needed(redis_url, SHARDS, said.append)
    assert len(said) == 2
    client.close()


def test_the_layout_is_recorded_once_and_a_store_of_another_shape_is_refused(
    any_redis_url: str,
) -> None:
    client: Any = sync_client(any_redis_url)
    check_layout(client, SHARDS)  # an empty store: recorded
    assert read_layout(client) == {"version": "2", "shards": "3"}
    check_layout(client, SHARDS)
    with pytest.raises(FailedPrecondition, match=r"written for 3 shards.*configured for 2"):
        check_layout(client, 2)
    client.hset("gtr:layout", "version", "3")
    with pytest.raises(FailedPrecondition, match="newer than this code's"):
        check_layout(client, SHARDS)
    assert cli(["redis", "layout", "--redis-url", any_redis_url, "--shards", "3"]) == 1
    client.close()
