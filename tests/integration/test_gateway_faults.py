"""The defects found by probing the running stack under load and faults (issue #11).

One module-wide stack of real processes: a Redis server that the tests kill and
restart, 2 index shards × 2 replica processes (one is SIGSTOPped by a test), and a
gateway process with the in-process encoder, driven over gRPC as a client would.
Each test failed before its fix (checked against the code before it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

import gtr_client
from retrieval.v1 import (
    common_pb2,
    documents_pb2,
    documents_pb2_grpc,
    index_pb2,
    index_pb2_grpc,
    search_pb2,
    search_pb2_grpc,
)
from services.common.domain import IndexResult
from services.common.errors import DeadlineExceeded, Unavailable
from services.index import convert
from services.index.client.router import ShardRouter
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.query import IndexQuery
from services.index.keys import DocKeys
from tests.support.log_end import FUTURE, log_end_moved
from tests.support.processes import (
    RestartableRedis,
    free_port,
    pythonpath,
    start_redis,
    stop_process,
)
from tests.support.shards import ROOT, ShardCluster, run_shards, train_test_index

# Slow as a whole: hung, killed and overloaded shards, Triton and Redis behind a real gateway.
pytestmark = pytest.mark.slow

N_DOCS = 1200
GATEWAY_DEFAULT_TIMEOUT_S = 2.0
SHARD_SETTINGS = {"default-timeout-s": "2"}


@dataclass
class Stack:
    redis: RestartableRedis
    cluster: ShardCluster
    gateway: str
    vectors: np.ndarray


def _wait_serving(address: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited:\n{log.read_text()[-3000:]}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.1)
    raise TimeoutError(f"gateway not serving:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, scifact_dir: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("faults")
    vectors = np.load(scifact_dir / "corpus.all-MiniLM-L6-v2.npy")[:2000].astype(np.float32)
    index_dir = train_test_index(vectors, tmp / "index", nlist=32)
    port = free_port()
    store = RestartableRedis(port, tmp / "redis", start_redis(tmp / "redis", port))
    lines = (scifact_dir / "corpus.jsonl").read_text().splitlines()[:N_DOCS]
    docs = [json.loads(line) for line in lines]

    async def ingest() -> None:
        writer = ChangeLogWriter.connect(store.url, num_shards=2, dim=vectors.shape[1])
        for i in range(0, N_DOCS, 200):
            await writer.upsert(
                [
                    DocRecord(f"doc-{j}", vectors[j], docs[j]["title"], docs[j]["text"])
                    for j in range(i, min(i + 200, N_DOCS))
                ]
            )
        await writer.close()

    asyncio.run(ingest())
    try:
        with run_shards(
            index_dir, store.url, tmp, shards=2, replicas=2, settings=SHARD_SETTINGS
        ) as cluster:
            gw_port = free_port()
            spec = ";".join(",".join(r) for r in cluster.addresses)
            log = tmp / "gateway.log"
            env = {**os.environ, "PYTHONPATH": pythonpath(ROOT), "OMP_NUM_THREADS": "1"}
            with log.open("ab") as out:
                gateway = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "services.gateway.server",
                        "--port",
                        str(gw_port),
                        "--redis-url",
                        store.url,
                        "--shards",
                        spec,
                        "--encoder",
                        "inprocess",
                        "--log-level",
                        "WARNING",
                        "--default-timeout-s",
                        str(GATEWAY_DEFAULT_TIMEOUT_S),
                        "--redis-max-connections",
                        "8",
                        "--no-auth",
                    ],
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            try:
                address = f"127.0.0.1:{gw_port}"
                _wait_serving(address, gateway, log)
                yield Stack(store, cluster, address, vectors)
            finally:
                stop_process(gateway)
    finally:
        stop_process(store.process)


def _search(address: str, request: search_pb2.SearchRequest, timeout: float | None = 30):
    with grpc.insecure_channel(address) as channel:
        return search_pb2_grpc.SearchServiceStub(channel).Search(request, timeout=timeout)


def _code(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()  # type: ignore[no-any-return]


# --- 1. documents of a search in one round trip, through a bounded pool ---------------


def test_searches_that_fetch_many_documents_succeed_with_a_small_pool(stack: Stack) -> None:
    """k=101 and k=1000 (one HGETALL per hit used to exhaust redis-py's pool), a batch of
    64 queries, and 300 concurrent searches, against a gateway with 8 Redis connections."""
    for k in (101, 1000):
        # every inverted list probed (nlist 32): k hits exist whatever the tuned nprobe
        request = search_pb2.SearchRequest(query="cell biology", k=k, nprobe=32)
        reply = _search(stack.gateway, request)
        assert len(reply.hits) == min(k, N_DOCS) and all(h.text for h in reply.hits)
        assert not reply.partial

    async def load() -> None:
        async with grpc.aio.insecure_channel(stack.gateway) as channel:
            stub = search_pb2_grpc.SearchServiceStub(channel)
            batch = await stub.BatchSearch(
                search_pb2.BatchSearchRequest(
                    requests=[
                        search_pb2.SearchRequest(query=f"protein {i}", k=2) for i in range(64)
                    ]
                ),
                timeout=60,
            )
            assert [len(r.hits) for r in batch.responses] == [2] * 64
            replies = await asyncio.gather(
                *[
                    stub.Search(search_pb2.SearchRequest(query=f"gene {i}", k=10), timeout=60)
                    for i in range(300)
                ]
            )
            assert all(len(r.hits) == 10 and not r.partial for r in replies)

    asyncio.run(load())


def test_ids_only_searches_fetch_no_document(stack: Stack) -> None:
    reply = _search(stack.gateway, search_pb2.SearchRequest(query="cancer", k=5, ids_only=True))
    assert len(reply.hits) == 5 and not any(h.text or h.title for h in reply.hits)
    assert reply.timings.fetch_ms == 0


def test_a_batch_answer_is_bounded_and_our_client_receives_the_largest(stack: Stack) -> None:
    """64 queries at k=1000 built a 6.8 MB answer (stdlib documents), over the 4 MB that
    a default gRPC client receives. A batch's k summed is at most 10,000 (INVALID_ARGUMENT
    before any work), and the SDK (the CLI's client) receives what the gateway may send (up
    to its --max-message-mb, 64): the largest batch allowed, here over 4 MB, arrives whole."""
    too_big = search_pb2.BatchSearchRequest(
        requests=[search_pb2.SearchRequest(query=f"protein {i}", k=1000) for i in range(64)]
    )
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = search_pb2_grpc.SearchServiceStub(channel)
        assert _code(lambda: stub.BatchSearch(too_big, timeout=60)) is (
            grpc.StatusCode.INVALID_ARGUMENT
        )
    largest = [gtr_client.Query(f"protein {i}", k=1000, nprobe=32) for i in range(10)]
    with gtr_client.Client(stack.gateway, env=False) as cli:
        results = cli.batch_search(largest, timeout=60)
    assert [len(r.hits) for r in results] == [1000] * 10
    text_bytes = sum(len(h.text.encode()) + len(h.title.encode()) for r in results for h in r)
    assert text_bytes > 4 * 1024 * 1024, "not larger than a default client receives"


# --- 2. deadlines of coalesced searches, and no OK from zero shards --------------------


def test_tiny_deadlines_do_not_empty_the_searches_of_other_clients(stack: Stack) -> None:
    queries = stack.vectors[N_DOCS : N_DOCS + 60]

    async def run() -> tuple[list[IndexResult | BaseException], list[IndexResult | BaseException]]:
        router = ShardRouter(stack.cluster.addresses)
        try:
            # streams open, quantizer read
            await router.search(IndexQuery(queries[:1], 5), timeout=10)
            patient, hasty = [], []
            for wave in range(6):
                batch = queries[wave * 10 : wave * 10 + 10]
                results = await asyncio.gather(
                    *[
                        router.search(IndexQuery(q[None], 5), timeout=0.012 if i % 3 == 0 else 5.0)
                        for i, q in enumerate(batch)
                    ],
                    return_exceptions=True,
                )
                patient += [r for i, r in enumerate(results) if i % 3]
                hasty += [r for i, r in enumerate(results) if i % 3 == 0]
            return patient, hasty
        finally:
            await router.close()

    patient, hasty = asyncio.run(run())
    for result in patient:
        assert not isinstance(result, BaseException), result
        assert not result.missing_shards and len(result.hits[0]) == 5  # type: ignore[attr-defined]
    for result in hasty:  # its own deadline may pass, but never as an empty OK
        if not isinstance(result, BaseException):
            assert len(result.missing_shards) < 2 and result.hits[0]  # type: ignore[attr-defined]
        else:
            assert isinstance(result, DeadlineExceeded), result


def test_no_shard_answering_is_an_error_not_an_empty_answer(stack: Stack) -> None:
    async def run() -> None:
        router = ShardRouter(stack.cluster.addresses)
        try:
            with pytest.raises(DeadlineExceeded):
                await router.search(IndexQuery(stack.vectors[:1], 5), timeout=0.0005)
            with pytest.raises(DeadlineExceeded):
                batch = IndexQuery(stack.vectors[:3], 5)  # not coalesced
                await router.search(batch, timeout=0.0005)
        finally:
            await router.close()
        down = ShardRouter([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]])
        try:
            with pytest.raises(Unavailable):
                await down.search(IndexQuery(stack.vectors[:1], 5), timeout=5)
        finally:
            await down.close()

    asyncio.run(run())


# --- 3. a replica that hangs --------------------------------------------------------------


def test_a_hung_replica_costs_no_partial_result(stack: Stack) -> None:
    """SIGSTOP one replica of each shard: every search still answers from all shards."""
    stopped = [stack.cluster.replica(0, 0), stack.cluster.replica(1, 1)]
    for proc in stopped:
        assert proc.process is not None
        proc.process.send_signal(signal.SIGSTOP)
    try:

        async def run() -> list[search_pb2.SearchResponse]:
            async with grpc.aio.insecure_channel(stack.gateway) as channel:
                stub = search_pb2_grpc.SearchServiceStub(channel)
                replies = []
                for i in range(40):
                    request = search_pb2.SearchRequest(query=f"virus {i}", k=10)
                    # room for a slow machine: a router that waited on the hung replica
                    # would still answer partial (or not at all) within it
                    replies.append(await stub.Search(request, timeout=5.0))
                return replies

        replies = asyncio.run(run())
    finally:
        for proc in stopped:
            assert proc.process is not None
            proc.process.send_signal(signal.SIGCONT)
    assert [list(r.missing_shards) for r in replies] == [[]] * len(replies)
    assert all(len(r.hits) == 10 for r in replies)


def test_a_shard_whose_replicas_all_hang_costs_a_partial_answer_within_the_deadline(
    stack: Stack,
) -> None:
    """SIGSTOP both replicas of shard 1: every search with a 1 s deadline, 26 one after
    the other and then 8 at once, is answered OK within it, from shard 0 alone and marked
    partial (the probe of issue #22 saw 2 of 26 end DEADLINE_EXCEEDED; 26 at once, 24 did:
    searches queued behind the router's two waves, which waited for the hung shard until
    their deadline, got no answer at all). More at once would measure this machine's
    encoder: with the in-process encoder 26 queries take 0.4 to 2 s here."""
    stopped = [stack.cluster.replica(1, 0), stack.cluster.replica(1, 1)]
    for proc in stopped:
        assert proc.process is not None
        proc.process.send_signal(signal.SIGSTOP)

    async def one(stub: search_pb2_grpc.SearchServiceStub, i: int) -> object:
        request = search_pb2.SearchRequest(query=f"hung shard {i}", k=10)
        try:
            return await stub.Search(request, timeout=1.0)
        except grpc.aio.AioRpcError as exc:
            return exc.code()

    async def run() -> tuple[list[object], list[object]]:
        async with grpc.aio.insecure_channel(stack.gateway) as channel:
            stub = search_pb2_grpc.SearchServiceStub(channel)
            in_turn = [await one(stub, 100 + i) for i in range(26)]
            together = await asyncio.gather(*[one(stub, i) for i in range(8)])
            return in_turn, together

    try:
        in_turn, together = asyncio.run(run())
    finally:
        for proc in stopped:
            assert proc.process is not None
            proc.process.send_signal(signal.SIGCONT)
    for replies in (in_turn, together):
        codes = [r for r in replies if isinstance(r, grpc.StatusCode)]
        assert not codes, f"{len(codes)} of {len(replies)} failed: {codes}"
        for reply in replies:
            assert isinstance(reply, search_pb2.SearchResponse)
            assert reply.partial and list(reply.missing_shards) == [1]
            assert len(reply.hits) == 10 and {h.shard for h in reply.hits} == {0}


# --- 4. every request has a deadline ------------------------------------------------------


def test_a_search_without_deadline_gets_the_gateways_default(stack: Stack) -> None:
    """A SESSION read with a token from the future on every shard, sent with no deadline,
    is answered DEADLINE_EXCEEDED by the gateway itself (the client set none), not left
    waiting (it used to wait for ever)."""
    request = search_pb2.SearchRequest(
        query="immune response",
        k=3,
        consistency=common_pb2.CONSISTENCY_SESSION,
        write_token=common_pb2.WriteToken(
            positions=[common_pb2.ShardPosition(shard=s, position=FUTURE) for s in (0, 1)]
        ),
    )

    async def run() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(stack.gateway) as channel:
            stub = search_pb2_grpc.SearchServiceStub(channel)
            # the test's own guard, 10× the gateway's default: a hang fails the test
            async with asyncio.timeout(10 * GATEWAY_DEFAULT_TIMEOUT_S):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Search(request)  # no deadline
            return err.value.code()

    with log_end_moved(stack.redis.url, [0, 1]):  # FUTURE is not past the logs' end
        assert asyncio.run(run()) is grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_shard_search_without_deadline_gets_the_shards_default(stack: Stack) -> None:
    request = index_pb2.ShardSearchRequest(
        shard=0,
        queries=convert.vectors_to_pb(stack.vectors[:1]),
        k=3,
        consistency=common_pb2.CONSISTENCY_SESSION,
        min_position=FUTURE,
    )

    async def run() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(stack.cluster.replica(0, 1).address) as channel:
            stub = index_pb2_grpc.IndexShardServiceStub(channel)
            async with asyncio.timeout(20):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Search(request)  # no deadline
            return err.value.code()

    with log_end_moved(stack.redis.url, [0]):
        assert asyncio.run(run()) is grpc.StatusCode.DEADLINE_EXCEEDED


# --- 5. malformed write-token positions ----------------------------------------------------


@pytest.mark.parametrize(
    "position", ["²", "1-²", "7" * 5000, "18446744073709551616-0", "1-2-3", "-1", " 1", "1"]
)
def test_malformed_positions_are_invalid_argument(stack: Stack, position: str) -> None:
    request = search_pb2.SearchRequest(
        query="x",
        k=1,
        consistency=common_pb2.CONSISTENCY_SESSION,
        write_token=common_pb2.WriteToken(
            positions=[common_pb2.ShardPosition(shard=0, position=position)]
        ),
    )
    code = _code(lambda: _search(stack.gateway, request, timeout=10))
    assert code is grpc.StatusCode.INVALID_ARGUMENT

    shard_request = index_pb2.ShardSearchRequest(
        shard=0,
        queries=convert.vectors_to_pb(stack.vectors[:1]),
        k=1,
        consistency=common_pb2.CONSISTENCY_SESSION,
        min_position=position,
    )
    with grpc.insecure_channel(stack.cluster.replica(0, 1).address) as channel:
        stub = index_pb2_grpc.IndexShardServiceStub(channel)
        assert _code(lambda: stub.Search(shard_request, timeout=10)) is (
            grpc.StatusCode.INVALID_ARGUMENT
        )


# --- 9. ids and long documents ----------------------------------------------------------------


@pytest.mark.parametrize("doc_id", [" ", "a\u0085b", "line\u2028sep", "tab\there", " padded"])
def test_blank_and_control_character_ids_are_refused(stack: Stack, doc_id: str) -> None:
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = documents_pb2_grpc.DocumentServiceStub(channel)
        request = documents_pb2.UpsertRequest(
            documents=[documents_pb2.Document(id=doc_id, text="some text")]
        )
        assert _code(lambda: stub.Upsert(request, timeout=10)) is (grpc.StatusCode.INVALID_ARGUMENT)
    client = redis.Redis.from_url(stack.redis.url)
    assert not client.exists(DocKeys(len(stack.cluster.processes)).doc(doc_id))
    client.close()


def test_a_megabyte_document_is_stored_whole_and_embedded_from_its_start(stack: Stack) -> None:
    words = [f"w{i % 997}" for i in range(200_000)]
    text = " ".join(words)[: 1 << 20]
    head = "Tuberculosis bacteria resist antibiotics in macrophages."
    doc = documents_pb2.Document(id="huge-doc", title="", text=f"{head} {text}"[: (1 << 20)])
    with grpc.insecure_channel(stack.gateway) as channel:
        docs = documents_pb2_grpc.DocumentServiceStub(channel)
        reply = docs.Upsert(documents_pb2.UpsertRequest(documents=[doc]), timeout=30)
        assert reply.upserted == 1 and reply.truncated == 1
        stored = docs.Get(documents_pb2.GetRequest(id="huge-doc"), timeout=10).document
        assert stored.text == doc.text
        found = _search(
            stack.gateway,
            search_pb2.SearchRequest(
                query=head,
                k=10,
                consistency=common_pb2.CONSISTENCY_SESSION,
                write_token=reply.write_token,
            ),
        )
        assert "huge-doc" in [h.id for h in found.hits]
        docs.Delete(documents_pb2.DeleteRequest(ids=["huge-doc"]), timeout=10)


# --- 6. and 7. Redis restarts and outages --------------------------------------------------


def test_strong_reads_are_unavailable_while_redis_is_down(stack: Stack) -> None:
    stack.redis.kill()
    try:
        strong = search_pb2.SearchRequest(
            query="heart disease", k=3, consistency=common_pb2.CONSISTENCY_STRONG
        )
        assert _code(lambda: _search(stack.gateway, strong, timeout=10)) is (
            grpc.StatusCode.UNAVAILABLE
        )
        # the shards search without Redis: an EVENTUAL ids-only search still answers
        eventual = search_pb2.SearchRequest(query="heart disease", k=3, ids_only=True)
        assert len(_search(stack.gateway, eventual, timeout=10).hits) == 3
    finally:
        stack.redis.start()


def test_the_gateway_recovers_from_a_redis_restart_at_once(stack: Stack) -> None:
    """Pooled connections from before a kill -9 and restart of Redis are not used stale:
    the first requests after it succeed (it used to be UNAVAILABLE "Connection lost")."""
    with grpc.insecure_channel(stack.gateway) as channel:
        search = search_pb2_grpc.SearchServiceStub(channel)
        batch = search_pb2.BatchSearchRequest(
            requests=[search_pb2.SearchRequest(query=f"diabetes {i}", k=5) for i in range(8)]
        )
        assert len(search.BatchSearch(batch, timeout=30).responses) == 8  # fills the pool
        stack.redis.kill()
        stack.redis.start()
        replies = search.BatchSearch(batch, timeout=30)
        assert [len(r.hits) for r in replies.responses] == [5] * 8
        docs = documents_pb2_grpc.DocumentServiceStub(channel)
        assert docs.Get(documents_pb2.GetRequest(id="doc-7"), timeout=10).document.text


def test_a_search_sent_while_redis_restarts_waits_for_it(stack: Stack) -> None:
    """Reads retry (within the deadline and --redis-read-retry-s) while Redis is down: a
    search sent during the restart answers once Redis is back, instead of UNAVAILABLE."""
    with grpc.insecure_channel(stack.gateway) as channel:
        search = search_pb2_grpc.SearchServiceStub(channel)
        stack.redis.kill()
        try:
            future = search.Search.future(
                search_pb2.SearchRequest(query="obesity and insulin", k=5), timeout=30
            )
            assert not future.done()  # it cannot be answered without Redis
        finally:
            stack.redis.start()
        assert len(future.result().hits) == 5


# --- issue #33 point 5: what a client reads of an inner hop's failure ------------------


def _details_of(call) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details() or ""


def _no_internal_address(details: str, stack: Stack) -> None:
    internal = [a for r in stack.cluster.addresses for a in r]
    internal += [stack.redis.url.split("//")[-1].split("/")[0]]
    for address in internal:
        assert address not in details, (address, details)
    assert "127.0.0.1" not in details and "localhost" not in details, details


def test_no_error_a_client_reads_names_an_internal_address(stack: Stack) -> None:
    """A shard killed (both replicas of shard 1) and Redis killed: the search, upsert,
    get and delete errors say what failed (which shard) but name no host:port of a shard
    or of Redis; before, "shard 1 replica 127.0.0.1:<port>: ..." and Redis's address
    reached the client."""
    seen: list[tuple[grpc.StatusCode, str]] = []
    down = [stack.cluster.replica(1, 0), stack.cluster.replica(1, 1)]
    for proc in down:
        proc.kill()
    try:
        complete = search_pb2.SearchRequest(query="cancer cells", k=5, require_complete=True)
        code, details = _details_of(lambda: _search(stack.gateway, complete, timeout=10))
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert "shard 1" in details, details  # which shard, still said
        seen.append((code, details))
    finally:
        for proc in down:
            proc.launch()
    stack.redis.kill()
    try:
        with grpc.insecure_channel(stack.gateway) as channel:
            docs = documents_pb2_grpc.DocumentServiceStub(channel)
            strong = search_pb2.SearchRequest(
                query="heart disease", k=3, consistency=common_pb2.CONSISTENCY_STRONG
            )
            new = documents_pb2.Document(id="leak-1", text="a document")
            for call in (
                lambda: _search(stack.gateway, strong, timeout=10),
                lambda: docs.Upsert(documents_pb2.UpsertRequest(documents=[new]), timeout=10),
                lambda: docs.Get(documents_pb2.GetRequest(id="doc-7"), timeout=10),
                lambda: docs.Delete(documents_pb2.DeleteRequest(ids=["doc-9999"]), timeout=10),
            ):
                seen.append(_details_of(call))
    finally:
        stack.redis.start()
    assert len(seen) == 5
    for code, details in seen:
        assert code is not grpc.StatusCode.OK
        _no_internal_address(details, stack)
