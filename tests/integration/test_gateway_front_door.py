"""The gateway's front door (issue #13 items 3 and 7), against real servers on free ports.

A real Redis, a real index shard, a real reranker (a tiny CELI checkpoint) and the
gateway, all gRPC servers in the test's event loop. Requests are held in flight by
something real that waits: SESSION searches whose write token names a log position
from the future (the log's end moved there, tests/support/log_end.py), so the shard
waits for it until the search's deadline (or until the test cancels the call).

- admission control: over ``--max-in-flight`` a call is refused RESOURCE_EXHAUSTED with
  a ``retry-after-ms`` hint before any work, while health and reflection still answer;
- shedding: past the high-water mark the rerank depth shrinks, at the limit the rerank
  is skipped and the response says why, and only over the limit is a search refused;
- health: a gateway whose Redis is killed answers NOT_SERVING, and SERVING again once
  Redis is back.

Each test failed on the code before the change: the limit did not exist (every search
was admitted, the rerank kept its depth) and the gateway stayed SERVING without Redis.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import gtr_client
from retrieval.v1 import common_pb2, documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc
from services.gateway.server import Gateway, start_gateway
from services.gateway.servicer import HITS_PER_UNIT
from services.gateway.settings import GatewaySettings
from services.index.server.process import RunningShard, start_shard
from services.rerank.serve.server import Reranker, start_rerank
from services.rerank.serve.settings import RerankSettings
from services.stack.config import default_max_in_flight
from tests.support.log_end import FUTURE, log_end_moved
from tests.support.processes import await_until, free_port, start_redis, stop_process
from tests.support.rerank import WORDS, tiny_checkpoint
from tests.support.shards import train_test_index
from tests.support.stack import shard_settings

DOCS = [
    documents_pb2.Document(id=f"d{i:02d}", title=f"topic {i}", text=f"{WORDS[i % 10]} doc {i}")
    for i in range(20)
]
# ms per query at each rerank depth, as in tests/e2e/test_gateway_rerank.py: at an 80 s
# deadline 60 % of it (48 s) fits depth 12; half of that (24 s) only depth 4.
TABLE = {"ms_per_query_at_depth": {"4": 20_000.0, "12": 40_000.0}}
LIMIT = 8  # high-water mark 75 %: 6 in flight; the 7th shrinks, the 8th skips, the 9th waits


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory, scifact_dir: Path) -> Path:
    vectors = np.load(scifact_dir / "corpus.all-MiniLM-L6-v2.npy")[:2000].astype(np.float32)
    return train_test_index(vectors, tmp_path_factory.mktemp("index"), nlist=8, nprobe=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("rerank"), WORDS)


@dataclass
class Front:
    gateway: Gateway
    channel: grpc.aio.Channel

    @property
    def search(self) -> search_pb2_grpc.SearchServiceStub:
        return search_pb2_grpc.SearchServiceStub(self.channel)

    @property
    def in_flight(self) -> int:
        return self.gateway.server.admission.in_flight


@asynccontextmanager
async def front_door(
    redis_url: str, index_dir: Path, tmp: Path, *, rerank: Path | None = None, **gateway: object
) -> AsyncIterator[Front]:
    """One shard, an optional reranker, a gateway with ``gateway`` settings; 20 documents."""
    shard: RunningShard = await start_shard(shard_settings(0, 1, 0, redis_url, index_dir, tmp))
    reranker: Reranker | None = None
    gw: Gateway | None = None
    try:
        # one channel holds every call here: no per-client share unless a test sets one
        extra: dict[str, object] = {"client_share": 1.0, **gateway}
        if rerank is not None:
            reranker = await start_rerank(RerankSettings(port=0, checkpoint=str(rerank), threads=1))
            table = tmp / "depths.json"
            table.write_text(json.dumps(TABLE))
            extra |= {"rerank_url": f"127.0.0.1:{reranker.port}", "rerank_depth_table": str(table)}
        gw = await start_gateway(
            GatewaySettings(
                port=0,
                redis_url=redis_url,
                shards=f"127.0.0.1:{shard.port}",
                encoder="inprocess",
                auth=False,
                **extra,  # type: ignore[arg-type]
            )
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
            up = await documents_pb2_grpc.DocumentServiceStub(channel).Upsert(
                documents_pb2.UpsertRequest(documents=DOCS), timeout=60
            )
            assert up.upserted == len(DOCS)
            with log_end_moved(redis_url, [0]):  # held() waits for FUTURE: within the log
                yield Front(gw, channel)
    finally:
        if gw is not None:
            await gw.close(0)
        if reranker is not None:
            await reranker.close(0)
        await shard.close(0, snapshot=False)


@asynccontextmanager
async def held(front: Front, count: int) -> AsyncIterator[None]:
    """``count`` searches in flight at the gateway, each waiting in the shard for a log
    position from the future (a 60 s deadline); cancelled on exit."""
    before = front.in_flight
    calls = [
        front.search.Search(
            search_pb2.SearchRequest(
                query=f"held {i}",
                k=3,
                consistency=common_pb2.CONSISTENCY_SESSION,
                write_token=common_pb2.WriteToken(
                    positions=[common_pb2.ShardPosition(shard=0, position=FUTURE)]
                ),
            ),
            timeout=60,
        )
        for i in range(count)
    ]
    try:
        await await_until(
            lambda: front.in_flight == before + count, f"{count} searches in flight", 30, 0.02
        )
        assert not any(call.done() for call in calls)
        yield
    finally:
        for call in calls:
            call.cancel()
        # a cancel normally ends them at once; under heavy load (CI beside other work) one
        # was seen still in flight after 30 s, so wait past their own 60-s deadline
        await await_until(lambda: front.in_flight == before, "the held searches ended", 75, 0.02)


def _reranked(query: str = "read a csv file row by row") -> search_pb2.SearchRequest:
    return search_pb2.SearchRequest(
        query=query,
        k=3,
        consistency=common_pb2.CONSISTENCY_STRONG,
        rerank=search_pb2.RerankOptions(enabled=True),  # depth 0: the gateway chooses
    )


async def _services(channel: grpc.aio.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
    )
    async for reply in call:
        return [s.name for s in reply.list_services_response.service]
    return []


@pytest.mark.slow
def test_over_the_in_flight_limit_a_call_is_resource_exhausted_with_a_retry_hint(
    redis_url: str, index_dir: Path, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with front_door(redis_url, index_dir, tmp_path, max_in_flight=2) as front:
            async with held(front, 2):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await front.search.Search(search_pb2.SearchRequest(query="x", k=1), timeout=10)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                trailing = dict(refused.value.trailing_metadata() or ())
                assert trailing.get("retry-after-ms") == "100", trailing
                assert trailing.get("grpc-retry-pushback-ms") == "100", trailing
                assert "limit 2" in (refused.value.details() or "")

                docs = documents_pb2_grpc.DocumentServiceStub(front.channel)
                with pytest.raises(grpc.aio.AioRpcError) as write:
                    await docs.Upsert(documents_pb2.UpsertRequest(documents=DOCS[:1]), timeout=10)
                assert write.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

                # probes and tooling still answer at the limit
                health = await health_pb2_grpc.HealthStub(front.channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                assert "retrieval.v1.SearchService" in await _services(front.channel)
                assert front.in_flight == 2

            reply = await front.search.Search(search_pb2.SearchRequest(query="x", k=1), timeout=30)
            assert len(reply.hits) == 1

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_burst_over_the_default_limit_of_up_is_refused_with_a_retry_hint(
    redis_url: str, index_dir: Path, tmp_path: Path
) -> None:
    """Issue #33 point 4: the gateway as ``up`` starts it by default (its limit derived
    from the CPUs, 16 per core) is full once that many small searches are in flight; a
    burst beyond it is answered RESOURCE_EXHAUSTED with ``retry-after-ms``, every call,
    at once (before, ``up`` passed no limit and a burst queued until its deadline)."""
    limit = default_max_in_flight()

    async def scenario() -> None:
        async with front_door(redis_url, index_dir, tmp_path, max_in_flight=limit) as front:
            async with held(front, limit):
                burst = [
                    front.search.Search(search_pb2.SearchRequest(query=f"b{i}", k=1), timeout=10)
                    for i in range(16)
                ]
                answers = await asyncio.gather(*burst, return_exceptions=True)
                for answer in answers:
                    assert isinstance(answer, grpc.aio.AioRpcError), answer
                    assert answer.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    trailing = dict(answer.trailing_metadata() or ())
                    assert trailing.get("retry-after-ms") == "100", trailing
                assert front.in_flight == limit

    asyncio.run(scenario())


def test_the_in_flight_limit_counts_a_search_by_its_hits(
    redis_url: str, index_dir: Path, tmp_path: Path
) -> None:
    """A search takes one unit of --max-in-flight per 25 hits (k=1000: forty, at most the
    whole limit): with 3 small searches held under a limit of 4, a k=1000 search is
    refused at once with the retry hint, a k=25 one is admitted; alone, k=1000 runs.
    Counted by calls, 32 searches at k=1000 saturated the gateway and 946 of 1,000
    concurrent ones ended DEADLINE_EXCEEDED (bench/overload.py)."""

    async def scenario() -> None:
        async with front_door(redis_url, index_dir, tmp_path, max_in_flight=4) as front:
            async with held(front, 3):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await front.search.Search(
                        search_pb2.SearchRequest(query="x", k=1000), timeout=10
                    )
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "this one takes 4" in (refused.value.details() or "")
                trailing = dict(refused.value.trailing_metadata() or ())
                assert trailing.get("retry-after-ms") == "100", trailing

                batch = search_pb2.BatchSearchRequest(  # 2 x 15 hits: two units
                    requests=[search_pb2.SearchRequest(query="x", k=15)] * 2
                )
                with pytest.raises(grpc.aio.AioRpcError) as too_many:
                    await front.search.BatchSearch(batch, timeout=10)
                assert too_many.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

                small = await front.search.Search(
                    search_pb2.SearchRequest(query="x", k=HITS_PER_UNIT), timeout=30
                )
                assert len(small.hits) == min(HITS_PER_UNIT, len(DOCS))
                assert front.in_flight == 3
            alone = await front.search.Search(
                search_pb2.SearchRequest(query="x", k=1000), timeout=30
            )
            assert len(alone.hits) == len(DOCS)

    asyncio.run(scenario())


def test_at_the_limit_a_call_is_refused_before_its_request_is_read(
    redis_url: str, index_dir: Path, tmp_path: Path
) -> None:
    """A full gateway refuses a call from its headers, before reading or parsing the
    request: a Search whose request message never comes is answered RESOURCE_EXHAUSTED
    with the hint at once. Before the change the refusal came only after the request was
    read and parsed, so this call waited for its message until its deadline
    (DEADLINE_EXCEEDED); under a burst of k=1000 searches every refusal queued behind
    that reading on a busy event loop and, of 1,000 calls at a 5 s deadline, 526 ended
    DEADLINE_EXCEEDED (bench/overload.py, docs/architecture.md)."""

    async def scenario() -> None:
        async with front_door(redis_url, index_dir, tmp_path, max_in_flight=2) as front:
            never = asyncio.Event()

            async def no_request() -> AsyncIterator[search_pb2.SearchRequest]:
                await never.wait()  # the request never comes
                yield search_pb2.SearchRequest(query="x", k=1000)

            unread = front.channel.stream_unary(
                "/retrieval.v1.SearchService/Search",
                request_serializer=search_pb2.SearchRequest.SerializeToString,
                response_deserializer=search_pb2.SearchResponse.FromString,
            )
            async with held(front, 2):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await unread(no_request(), timeout=10)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (
                    refused.value.code()
                )
                trailing = dict(refused.value.trailing_metadata() or ())
                assert trailing.get("retry-after-ms") == "100", trailing
                assert trailing.get("grpc-retry-pushback-ms") == "100", trailing
                assert front.in_flight == 2
            # with room, the same call is read, so it waits for its request (a short
            # deadline: it has none to read)
            with pytest.raises(grpc.aio.AioRpcError) as waited:
                await unread(no_request(), timeout=0.5)
            assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(scenario())


def test_a_retrying_client_waits_the_retry_after_hint_between_attempts(
    redis_url: str, index_dir: Path, tmp_path: Path
) -> None:
    """The SDK (the CLI's client) retries RESOURCE_EXHAUSTED after the gateway's
    ``retry-after-ms`` hint, never sooner (its own backoff, 0.1 s doubling, would make
    five attempts within a second), and does not begin a pause that would end past the
    call's deadline: with a 2 s hint and a 3 s deadline exactly two attempts reach the
    gateway (the first has 0.8 s to be refused, room for a slow machine's new channel),
    then the refusal is raised at once with its hint rather than a DEADLINE_EXCEEDED."""

    async def scenario() -> None:
        async with front_door(
            redis_url, index_dir, tmp_path, max_in_flight=2, retry_after_ms=2000
        ) as front:
            async with held(front, 2):
                before = _handled(front, "Search", "RESOURCE_EXHAUSTED")

                def search_from_the_cli() -> gtr_client.ResourceExhausted:
                    address = f"127.0.0.1:{front.gateway.port}"
                    with gtr_client.Client(address, env=False) as cli:
                        with pytest.raises(gtr_client.ResourceExhausted) as refused:
                            cli.search("x", k=1, timeout=3.0)
                        return refused.value

                refused = await asyncio.to_thread(search_from_the_cli)
                assert refused.retry_after_s == 2.0 and refused.attempts == 2, refused
                # the server counts a call once its answer is sent: await the second
                await await_until(
                    lambda: _handled(front, "Search", "RESOURCE_EXHAUSTED") - before >= 2,
                    "the gateway counted both refusals",
                    10,
                    0.02,
                )
                attempts = _handled(front, "Search", "RESOURCE_EXHAUSTED") - before
                assert attempts == 2, f"{attempts:.0f} attempts in 3 s with a 2 s hint"

    asyncio.run(scenario())


def _handled(front: Front, method: str, code: str) -> float:
    labels = {"service": "gateway", "method": method, "code": code, "transport": "grpc"}
    sample = front.gateway.registry.get_sample_value("grpc_server_handled_total", labels)
    return float(sample or 0.0)


def test_under_pressure_the_rerank_shrinks_then_is_skipped_before_a_search_is_refused(
    redis_url: str, index_dir: Path, checkpoint: Path, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with front_door(
            redis_url, index_dir, tmp_path, rerank=checkpoint, max_in_flight=LIMIT
        ) as front:
            calm = await front.search.Search(_reranked(), timeout=80)
            assert calm.reranked and calm.rerank_depth == 12, calm

            async with held(front, 6):  # the probe is the 7th: past the high-water mark
                shrunk = await front.search.Search(_reranked(), timeout=80)
                assert shrunk.reranked and shrunk.rerank_depth == 4, shrunk
                assert not shrunk.rerank_skipped

            async with held(front, LIMIT - 1):  # the probe is the last one admitted
                skipped = await front.search.Search(_reranked(), timeout=80)
                assert not skipped.reranked and skipped.rerank_skipped, skipped
                assert "shed under load" in skipped.rerank_skipped_reason
                assert len(skipped.hits) == 3
                assert [h.score for h in skipped.hits] == [
                    h.first_stage_score for h in skipped.hits
                ]

                named = _reranked()
                named.rerank.depth = 10  # a named depth is shed too
                also = await front.search.Search(named, timeout=80)
                assert also.rerank_skipped and not also.reranked

            async with held(front, LIMIT):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await front.search.Search(_reranked(), timeout=80)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

            again = await front.search.Search(_reranked(), timeout=80)
            assert again.reranked and again.rerank_depth == 12

    asyncio.run(scenario())


def test_a_gateway_whose_redis_is_killed_is_not_serving_until_redis_is_back(
    index_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    redis_dir = tmp_path / "redis"
    process = start_redis(redis_dir, port)
    url = f"redis://127.0.0.1:{port}/0"

    async def status(health: health_pb2_grpc.HealthStub) -> int:
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)

    async def await_status(health: health_pb2_grpc.HealthStub, wanted: int, what: str) -> None:
        async def reached() -> bool:
            return await status(health) == wanted

        await await_until(reached, what, timeout=30)

    async def scenario() -> None:
        nonlocal process
        async with front_door(url, index_dir, tmp_path) as front:
            health = health_pb2_grpc.HealthStub(front.channel)
            assert await status(health) == health_pb2.HealthCheckResponse.SERVING
            process.kill()  # kill -9: Redis gone
            process.wait(10)
            await await_status(health, health_pb2.HealthCheckResponse.NOT_SERVING, "Redis killed")
            process = start_redis(redis_dir, port)  # same port, same AOF
            await await_status(health, health_pb2.HealthCheckResponse.SERVING, "Redis back")
            reply = await front.search.Search(
                search_pb2.SearchRequest(query="read a csv file", k=2), timeout=30
            )
            assert len(reply.hits) == 2

    try:
        asyncio.run(scenario())
    finally:
        stop_process(process)


def _encodes(front: Front) -> float:
    return sum(
        sample.value
        for metric in front.gateway.registry.collect()
        if metric.name == "gtr_encode_calls"
        for sample in metric.samples
        if sample.name == "gtr_encode_calls_total"
    )


def test_a_query_over_the_term_limit_is_refused_before_it_is_encoded(
    redis_url: str, index_dir: Path, tmp_path: Path
) -> None:
    """Issue #33 point 5: a 2.4 KB hybrid query of 300 distinct words (the limit is 256)
    is INVALID_ARGUMENT from the gateway itself, the encoder not called; before, the
    gateway encoded it and a shard refused it ("shard 0 replica <address>: ...")."""
    words = " ".join(f"term{i:03d}" for i in range(300))

    async def scenario() -> None:
        async with front_door(redis_url, index_dir, tmp_path) as front:
            before = _encodes(front)
            for mode in (search_pb2.RETRIEVAL_MODE_HYBRID, search_pb2.RETRIEVAL_MODE_UNSPECIFIED):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await front.search.Search(
                        search_pb2.SearchRequest(query=words, k=5, mode=mode), timeout=30
                    )
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "query: 300 distinct terms" in (refused.value.details() or "")
                assert "shard" not in (refused.value.details() or "")
            assert _encodes(front) == before
            dense = search_pb2.SearchRequest(query=words, k=5, mode=search_pb2.RETRIEVAL_MODE_DENSE)
            assert len((await front.search.Search(dense, timeout=30)).hits) == 5
            assert _encodes(front) == before + 1  # the counter does count encodes

    asyncio.run(scenario())


@pytest.mark.slow
def test_under_load_a_client_over_its_share_is_refused_while_another_is_admitted(
    redis_url: str, index_dir: Path, tmp_path: Path
) -> None:
    """Issue #33 point 1: one client cannot take the whole admission limit. With a limit
    of 8 (high water 6) and a share of half (4), a client holding 6 is refused its 7th
    call, RESOURCE_EXHAUSTED naming its share, while another client (another connection)
    is still admitted and answered. Without the share the 7th was admitted and the other
    client's second call refused by the limit."""

    async def scenario() -> None:
        async with front_door(
            redis_url, index_dir, tmp_path, max_in_flight=LIMIT, client_share=0.5
        ) as front:
            async with held(front, 6):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await front.search.Search(search_pb2.SearchRequest(query="x", k=1), timeout=10)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "this client holds 6" in (refused.value.details() or "")
                trailing = dict(refused.value.trailing_metadata() or ())
                assert trailing.get("retry-after-ms") == "100", trailing
                address = f"127.0.0.1:{front.gateway.port}"
                # a connection of its own (channels of one process share one by default)
                local = [("grpc.use_local_subchannel_pool", 1)]
                async with grpc.aio.insecure_channel(address, options=local) as other:
                    stub = search_pb2_grpc.SearchServiceStub(other)
                    answers = await asyncio.gather(
                        *(
                            stub.Search(search_pb2.SearchRequest(query=q, k=1), timeout=30)
                            for q in ("topic", "doc")
                        )
                    )
                assert all(len(a.hits) == 1 for a in answers), answers

    asyncio.run(scenario())
