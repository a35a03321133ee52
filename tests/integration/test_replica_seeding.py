"""A shard scaled from 1 to 2 replicas after its log was trimmed: the new replica seeds
itself from its peer's snapshot (issue #16 item 2).

Real processes: a Redis server, replica processes of one shard on loopback addresses,
and a real DNS server standing in for the headless Service the chart gives as
``--peers`` (its answer also lists the new replica's own address, as a pod's own record
would once ready: it is passed over because it does not serve yet). Without ``--peers``
the new replica refuses to start (the log cannot be replayed); with it, it serves the
same answers as its peer, and a replica that lost its trained index too gets it from
the peer in the same transfer.
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
from services.index.core.trained import MANIFEST
from tests.support.dns import run_dns
from tests.support.processes import free_port, run_redis
from tests.support.shards import ShardProcess, scifact_vectors, shared_test_index, start_shard

FIRST, LATER = 3000, 4000  # documents before the snapshot that trims the log, and after


def _ingest(url: str, vectors: np.ndarray, start: int, stop: int, delete: list[str]) -> None:
    async def run() -> None:
        writer = ChangeLogWriter.connect(url, num_shards=1, dim=vectors.shape[1])
        try:
            for i in range(start, stop, 250):
                end = min(i + 250, stop)
                await writer.upsert([DocRecord(f"d{j}", vectors[j]) for j in range(i, end)])
            if delete:
                await writer.delete(delete)
        finally:
            await writer.close()

    asyncio.run(run())


def _search(proc: ShardProcess, queries: np.ndarray) -> tuple[list[str], np.ndarray, str]:
    request = convert.query_to_pb(
        ShardQuery(shard=0, vectors=queries, k=10, consistency=Consistency.STRONG)
    )
    with grpc.insecure_channel(proc.address) as channel:
        stub = index_pb2_grpc.IndexShardServiceStub(channel)
        answer = convert.answer_from_pb(stub.Search(request, timeout=30))
    return answer.top.ids, answer.top.scores, answer.applied_position


def _stats(proc: ShardProcess) -> index_pb2.ShardStats:
    with grpc.insecure_channel(proc.address) as channel:
        stats: index_pb2.ShardStats = index_pb2_grpc.IndexShardServiceStub(channel).Stats(
            index_pb2.ShardStatsRequest(), timeout=10
        )
        return stats


@pytest.mark.slow
def test_a_replica_added_after_the_log_was_trimmed_seeds_from_its_peer(
    scifact_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    vectors = scifact_vectors(scifact_dir)
    index_dir = shared_test_index(tmp_path_factory.getbasetemp(), vectors)
    port = free_port()
    with run_redis(tmp_path / "redis") as store, run_dns() as dns:
        _ingest(store.url, vectors, 0, FIRST, [])
        procs: list[ShardProcess] = []

        def launch(replica: str, host: str, peers: str | None = None, **kw: Path) -> ShardProcess:
            settings = (
                {"peers": peers, "seed-timeout-s": "120", "log-level": "INFO"} if peers else {}
            )
            proc = start_shard(
                index_dir=kw.get("index_dir", index_dir),
                redis_url=store.url,
                shard=0,
                shards=1,
                port=port,
                work_dir=tmp_path,
                replica=replica,
                host=host,
                settings=settings,
                wait=False,
            )
            procs.append(proc)
            return proc

        try:
            old = launch("r0", "127.0.0.2")
            old.wait_serving(120)
            with grpc.insecure_channel(old.address) as channel:
                index_pb2_grpc.IndexShardServiceStub(channel).Snapshot(
                    index_pb2.SnapshotRequest(), timeout=60
                )
            log = LogReader(redis.Redis.from_url(store.url), 0)
            assert log.trimmed_past(positions.ZERO), "the snapshot did not trim the log"
            # changes after the snapshot: the new replica must replay them on top of it
            _ingest(store.url, vectors, FIRST, LATER, delete=[f"d{j}" for j in range(40)])

            # without peers: the log cannot be replayed from 0, the start fails
            alone = launch("alone", "127.0.0.5")
            assert alone.process is not None
            assert alone.process.wait(120) != 0
            assert "trimmed past" in alone.log_tail(60)

            # a replica of another shard asking is the caller's mistake, said as such
            with grpc.insecure_channel(old.address) as channel:
                call = index_pb2_grpc.IndexShardServiceStub(channel).FetchSnapshot(
                    index_pb2.FetchSnapshotRequest(shard=1, replica="x"), timeout=30
                )
                with pytest.raises(grpc.RpcError) as refused:
                    list(call)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            dns.set("shard-0.test", ["127.0.0.2", "127.0.0.3"])
            peers = dns.target("shard-0.test", port)
            new = launch("r1", "127.0.0.3", peers)
            # a replica that lost its volume, the trained index on it included
            bare_index = tmp_path / "bare-index"
            bare = launch("r2", "127.0.0.4", peers, index_dir=bare_index)
            new.wait_serving(180)
            bare.wait_serving(180)

            queries = vectors[LATER : LATER + 50]
            want_ids, want_scores, want_position = _search(old, queries)
            assert want_position == log.tail()
            for proc in (new, bare):
                ids, scores, position = _search(proc, queries)
                assert position == want_position
                assert ids == want_ids
                np.testing.assert_array_equal(scores, want_scores)
                a, b = _stats(old), _stats(proc)
                assert (b.vectors, b.deleted, b.applied_position) == (
                    a.vectors,
                    a.deleted,
                    a.applied_position,
                )
                assert "seeded shard 0 from peer 127.0.0.2" in proc.log_tail(200)
            assert (bare_index / MANIFEST).exists()
            assert any(bare.snapshot_dir.glob("snap-*.npz"))
        finally:
            for proc in procs:
                proc.stop()


def test_a_replica_seeds_from_its_peer_over_mutual_tls(
    scifact_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """With TLS on every hop, the peer fetch is mTLS too: the peer found through DNS is
    an IP address its certificate does not name, so the name is checked instead; a
    replica without a client certificate is refused and its start fails."""
    from services.common.errors import FailedPrecondition
    from services.index.server.process import start_shard as start_in_process
    from services.index.server.settings import ShardSettings
    from services.stack.certs import make_certs

    vectors = scifact_vectors(scifact_dir)
    index_dir = shared_test_index(tmp_path_factory.getbasetemp(), vectors)
    certs = make_certs(tmp_path / "certs", names=["shard-0.test"])  # not 127.0.0.2
    server = {
        "tls_cert": str(certs.server_cert),
        "tls_key": str(certs.server_key),
        "tls_client_ca": str(certs.ca),
    }
    client = {
        "tls_ca": str(certs.ca),
        "tls_client_cert": str(certs.client_cert),
        "tls_client_key": str(certs.client_key),
    }
    port = free_port()
    with run_redis(tmp_path / "redis") as store, run_dns() as dns:
        _ingest(store.url, vectors, 0, 1000, [])
        dns.set("shard-0.test", ["127.0.0.2"])

        def settings(replica: str, host: str, **more: object) -> ShardSettings:
            return ShardSettings(
                host=host,
                port=port,
                shard=0,
                shards=1,
                replica=replica,
                redis_url=store.url,
                index_dir=str(index_dir),
                snapshot_dir=str(tmp_path / replica),
                snapshot_every_s=3600.0,
                search_threads=0,
                grace_seconds=0.5,
                **server,  # type: ignore[arg-type]
                **more,  # type: ignore[arg-type]
            )

        async def run() -> None:
            loop = asyncio.get_running_loop()
            old = await start_in_process(settings("r0", "127.0.0.2"))
            try:
                await loop.run_in_executor(None, old.replica.snapshot)
                assert old.replica.log.trimmed_past(positions.ZERO)
                peers = dns.target("shard-0.test", port)
                with pytest.raises(FailedPrecondition, match="no peer"):
                    await start_in_process(
                        settings("r1", "127.0.0.3", peers=peers, seed_timeout_s=2.5)
                    )
                new = await start_in_process(settings("r2", "127.0.0.4", peers=peers, **client))
                try:
                    assert new.replica.shard.applied == old.replica.shard.applied
                    assert len(new.replica.shard) == len(old.replica.shard) == 1000
                finally:
                    await new.close(snapshot=False)
            finally:
                await old.close(snapshot=False)

        asyncio.run(run())
