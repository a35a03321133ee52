"""Two edges of writing and reading your writes, through the real gateway over gRPC (one
stack for the module: a real redis-server, real shard and gateway servers):

- a document store that is full (Redis at ``maxmemory`` with ``noeviction``) refuses an
  upsert with RESOURCE_EXHAUSTED and nothing stored changes; deletes still free room;
- a SESSION write token whose position is past the end of a shard's log (from another
  store, or forged) is INVALID_ARGUMENT at once, not a wait until the deadline.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis

import gtr_client
from retrieval.v1 import common_pb2, documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc
from services.index.keys import DocKeys, log_key
from tests.support.background import BackgroundStack, stack_in_background
from tests.support.processes import RedisServer, run_redis, wait_until
from tests.support.sample_docs import STDLIB_DOCS
from tests.support.shards import scifact_vectors, shared_test_index

SHARDS = 2
DOCS = STDLIB_DOCS[:3]


@dataclass
class Front:
    bg: BackgroundStack
    store: RedisServer
    channel: grpc.Channel

    @property
    def docs(self) -> documents_pb2_grpc.DocumentServiceStub:
        return documents_pb2_grpc.DocumentServiceStub(self.channel)

    @property
    def search(self) -> search_pb2_grpc.SearchServiceStub:
        return search_pb2_grpc.SearchServiceStub(self.channel)

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.store.url)

    def handled(self, method: str, code: str) -> float:
        """How many calls of ``method`` the gateway answered with ``code``."""
        labels = {"service": "gateway", "method": method, "code": code, "transport": "grpc"}
        sample = self.bg.stack.gateway.registry.get_sample_value(
            "grpc_server_handled_total", labels
        )
        return float(sample or 0.0)

    def upsert(self, *docs: tuple[str, str, str]) -> common_pb2.WriteToken:
        reply = self.docs.Upsert(
            documents_pb2.UpsertRequest(
                documents=[documents_pb2.Document(id=i, title=t, text=x) for i, t, x in docs]
            ),
            timeout=60,
        )
        return reply.write_token


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, scifact_dir: Path) -> Iterator[Front]:
    index_dir = shared_test_index(tmp_path_factory.getbasetemp(), scifact_vectors(scifact_dir))
    tmp = tmp_path_factory.mktemp("write-edges")
    with (
        run_redis(tmp / "store") as store,
        stack_in_background(store.url, index_dir, tmp, shards=SHARDS) as bg,
    ):
        channel = grpc.insecure_channel(bg.address)
        try:
            yield Front(bg, store, channel)
        finally:
            channel.close()


def stored_state(client: redis.Redis, ids: list[str]) -> dict[str, object]:
    """What a write changes: the documents' hashes and versions, every shard log's
    length and newest id."""
    keys = DocKeys(SHARDS)
    state: dict[str, object] = {}
    for doc_id in ids:
        state[f"doc {doc_id}"] = client.hgetall(keys.doc(doc_id))
        state[f"ver {doc_id}"] = client.get(keys.version(doc_id))
    for shard in range(SHARDS):
        info = client.xinfo_stream(log_key(shard)) if client.exists(log_key(shard)) else {}
        state[f"log {shard}"] = (info.get("length"), info.get("last-generated-id"))
    return state


def test_a_full_store_refuses_an_upsert_with_resource_exhausted_and_changes_nothing(
    front: Front,
) -> None:
    front.upsert(*DOCS)
    client = front.redis()
    ids = [d[0] for d in DOCS] + ["py-new"]
    before = stored_state(client, ids)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")  # bytes: every write that needs memory is refused
    earlier = front.handled("Upsert", "RESOURCE_EXHAUSTED")
    try:
        with pytest.raises(grpc.RpcError) as refused:
            front.upsert(("py-csv", "csv.reader", "changed text"), ("py-new", "new", "a new doc"))
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        assert "full" in refused.value.details() and "maxmemory" in refused.value.details()
        assert stored_state(client, ids) == before, "a refused upsert stored nothing"

        # The SDK (the CLI's client) retries RESOURCE_EXHAUSTED with a retry hint (a busy
        # gateway), but the answer of a full store says not to (grpc-retry-pushback-ms
        # -1): it is sent once, not five times with up to 64 MiB each.
        # The server counts a call after its answer is sent: the refusal above may not be
        # counted yet, and counted late it would look like a retry of the one below.
        wait_until(
            lambda: front.handled("Upsert", "RESOURCE_EXHAUSTED") > earlier,
            "the gateway counted the first refused Upsert",
        )
        refusals = front.handled("Upsert", "RESOURCE_EXHAUSTED")
        with gtr_client.Client(front.bg.address, env=False) as cli:
            with pytest.raises(gtr_client.ResourceExhausted) as once:
                cli.upsert([gtr_client.Document("py-new", "a new doc", "new")], timeout=30)
        assert once.value.attempts == 1 and once.value.retry_after_s is None, once.value
        # The server counts a call after its answer is sent: await the count, then check
        # that it is one (every attempt of the client ended before the client's error).
        wait_until(
            lambda: front.handled("Upsert", "RESOURCE_EXHAUSTED") - refusals >= 1,
            "the gateway counted the refused Upsert",
        )
        assert front.handled("Upsert", "RESOURCE_EXHAUSTED") - refusals == 1, "retried"
        assert stored_state(client, ids) == before

        # a delete needs no room (DEL comes first in its script): it still works
        gone = front.docs.Delete(documents_pb2.DeleteRequest(ids=["py-hash"]), timeout=30)
        assert gone.deleted == 1
    finally:
        client.config_set("maxmemory", "0")

    token = front.upsert(("py-new", "new", "Compute a SHA-256 digest of a byte string."))
    reply = front.search.Search(
        search_pb2.SearchRequest(
            query="sha256 digest of bytes",
            k=3,
            consistency=common_pb2.CONSISTENCY_SESSION,
            write_token=token,
        ),
        timeout=30,
    )
    found = [h.id for h in reply.hits]
    assert "py-new" in found and "py-hash" not in found


def past_end(position: str, by_ms: int, by_seq: int) -> str:
    ms, seq = (int(p) for p in position.split("-"))
    return f"{ms + by_ms}-{seq + by_seq}"


def test_a_session_token_past_the_end_of_a_shard_log_is_invalid_argument(
    front: Front,
) -> None:
    token = front.upsert(*DOCS)
    client = front.redis()
    mine = token.positions[0]
    last = client.xinfo_stream(log_key(mine.shard))["last-generated-id"].decode()

    def search(positions: list[tuple[int, str]]) -> search_pb2.SearchResponse:
        forged = common_pb2.WriteToken(
            positions=[common_pb2.ShardPosition(shard=s, position=p) for s, p in positions]
        )
        return front.search.Search(
            search_pb2.SearchRequest(
                query="read a csv file",
                k=2,
                consistency=common_pb2.CONSISTENCY_SESSION,
                write_token=forged,
            ),
            timeout=30,  # far longer than the answer may take: a wait would end in it
        )

    # the log's own newest position is fine (it is applied or will be)
    assert search([(mine.shard, last)]).hits

    # one sequence number past the newest id, and an hour past it
    for beyond in (past_end(last, 0, 1), past_end(last, 3_600_000, 0)):
        with pytest.raises(grpc.RpcError) as refused:
            search([(mine.shard, beyond)])
        error = refused.value
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
        assert f"shard {mine.shard}" in error.details() and beyond in error.details()
