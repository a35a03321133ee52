"""The text index follows the change log exactly as the vectors do: real Redis, the real
change-log writer, replicas in-process (log order, read-your-writes, snapshot + replay
after a restart, a peer's snapshot after the log was trimmed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.transfer import Receiver, open_offer
from services.index.server.replica import ShardReplica
from services.index.server.settings import ShardSettings
from tests.support.processes import RedisServer, run_redis
from tests.support.shards import scifact_vectors, shared_test_index

N = 400
QUERIES = [
    "Vitamin D deficiency is associated with tuberculosis",
    "ALDH1 expression is associated with poorer prognosis for breast cancer",
    "zebrafish giraffe okapi",
]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with run_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


def _settings(url: str, index_dir: Path, snapshot_dir: Path, replica: str) -> ShardSettings:
    return ShardSettings(
        shard=0,
        shards=1,
        replica=replica,
        redis_url=url,
        index_dir=str(index_dir),
        snapshot_dir=str(snapshot_dir),
        snapshot_every_entries=1_000_000,
        snapshot_every_s=3600,
    )


def _sparse(replica: ShardReplica, k: int = 10) -> list[list[str]]:
    shard = replica.shard
    return [[d for d, _ in row] for row in shard.search_text(shard.query_terms(QUERIES), k).hits()]


async def _started(replica: ShardReplica, position: str) -> None:
    replica.start(asyncio.get_running_loop())
    await replica.wait_for(position, timeout=60)


async def _stopped(replica: ShardReplica) -> None:
    await asyncio.get_running_loop().run_in_executor(None, replica.stop, False)
    await replica.close()


def test_text_index_follows_the_log_through_restart_and_seeding(
    redis_server: RedisServer,
    scifact_dir: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    vectors = scifact_vectors(scifact_dir)
    index_dir = shared_test_index(tmp_path_factory.getbasetemp(), vectors)
    with open(scifact_dir / "corpus.jsonl", encoding="utf-8") as fh:
        docs = [json.loads(line) for _, line in zip(range(N), fh, strict=False)]
    records = [
        DocRecord(d["_id"], vectors[i], title=d["title"], text=d["text"])
        for i, d in enumerate(docs)
    ]
    url = redis_server.url

    async def run() -> None:
        writer = ChangeLogWriter.connect(url, 1, dim=vectors.shape[1])
        a = ShardReplica(_settings(url, index_dir, tmp_path / "a", "a"))
        try:
            token = {}
            for i in range(0, N, 100):
                token = await writer.upsert(records[i : i + 100])
            await _started(a, token[0])
            before = _sparse(a)
            assert all(before[:2]), "the claims find documents by their terms"
            gone = before[0][0]
            # read-your-writes for both indexes: once a token's position is applied,
            # the text of that write is searchable, in log order (rewrite, then delete)
            token = await writer.upsert(
                [DocRecord("zoo", vectors[N], title="Zebrafish", text="giraffe okapi")]
            )
            await a.wait_for(token[0], timeout=30)
            assert _sparse(a)[2][0] == "zoo"
            token = await writer.upsert([DocRecord("zoo", vectors[N], text="nothing left")])
            token, deleted, _ = await writer.delete([gone])
            assert deleted == [gone]
            await a.wait_for(token[0], timeout=30)
            after = _sparse(a)
            assert "zoo" not in after[2] and gone not in after[0]
            assert a.shard.stats().text is not None
            assert len(a.shard) == a.shard.stats().text.documents == N  # type: ignore[union-attr]

            # a snapshot, writes after it, a restart: snapshot + replay gives the same
            a.snapshot()
            token = await writer.upsert([DocRecord("late", vectors[N + 1], text="okapi okapi")])
            await a.wait_for(token[0], timeout=30)
            expected = _sparse(a)
            assert expected[2][0] == "late"
            await _stopped(a)
            a = ShardReplica(_settings(url, index_dir, tmp_path / "a", "a"))
            assert a.shard.applied != token[0]  # the snapshot is older than the last write
            await _started(a, token[0])
            assert _sparse(a) == expected

            # the log trimmed past everything: a new replica gets the peer's snapshot
            # (the files FetchSnapshot streams, through the same Receiver)
            a.snapshot()
            a.log.trim_below_snapshots()
            snap = a.snapshot()
            offer = open_offer(snap)
            receiver = Receiver(tmp_path / "b", index_dir, offer.position, offer.files)
            for i, offset, data in offer.chunks():
                receiver.write(i, offset, data)
            receiver.finish()
            offer.close()
            b = ShardReplica(_settings(url, index_dir, tmp_path / "b", "b"))
            assert b.shard.text is not None and b.shard.applied == snap.position
            await _started(b, token[0])
            assert _sparse(b) == expected
            token, _, _ = await writer.delete(["late"])
            await asyncio.gather(a.wait_for(token[0], 30), b.wait_for(token[0], 30))
            assert _sparse(a) == _sparse(b) and "late" not in _sparse(b)[2]
            await _stopped(b)
        finally:
            await _stopped(a)
            await writer.close()

    asyncio.run(run())
