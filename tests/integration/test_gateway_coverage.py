"""What the gateway promises a client, over gRPC against real servers, that the other
gateway tests do not already show (tests/e2e/ covers upsert → SESSION search → delete and
malformed requests, test_gateway_faults.py ids_only, deadlines and Redis faults,
test_gateway_front_door.py the in-flight limit and rerank shedding, test_gateway_rerank.py
the deadline-chosen rerank depth):

* filters: only documents whose metadata match every condition (any of its values);
* a BatchSearch whose searches differ in k, filter, ids_only, rerank and consistency:
  each answer follows its own request;
* a hit whose document was deleted after the shards answered is never returned;
* a shard down: a partial answer that names it, or UNAVAILABLE / DEADLINE_EXCEEDED with
  ``require_complete`` (last: it stops a shard of the module's stack).

One stack for the module: real Redis, two real shard servers, the gateway with the real
MiniLM encoder and a real rerank server (a tiny CELI checkpoint).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from retrieval.v1 import (
    common_pb2,
    documents_pb2,
    documents_pb2_grpc,
    search_pb2,
    search_pb2_grpc,
)
from services.index.core.ids import shard_of
from tests.support.background import BackgroundStack, scifact_stack_with_rerank

# id, title, text, metadata
PY, GO = {"lang": "py"}, {"lang": "go"}
DOCS = [
    ("csv-py", "csv.reader", "Read rows of a csv file one list at a time.", {**PY, "topic": "csv"}),
    ("csv-go", "encoding/csv", "Read records from a csv file in Go.", {**GO, "topic": "csv"}),
    ("csv-rs", "csv crate", "Read and write csv files in Rust.", {"lang": "rs", "topic": "csv"}),
    (
        "json-py",
        "json.loads",
        "Parse a json document into Python objects.",
        {**PY, "topic": "json"},
    ),
    ("json-go", "encoding/json", "Decode json into Go structs.", {**GO, "topic": "json"}),
    ("hash-py", "hashlib", "Compute a sha256 hash of bytes.", {**PY, "topic": "hash"}),
    (
        "pool-py",
        "ThreadPoolExecutor",
        "Run callables in a pool of threads.",
        {**PY, "topic": "thread"},
    ),
    ("nolang", "README", "A csv file reader without a language tag.", {}),
]
META = {d[0]: d[3] for d in DOCS}


class Front:
    def __init__(self, bg: BackgroundStack, store_url: str, nlist: int) -> None:
        self.bg = bg
        self.nlist = nlist
        self.channel = grpc.insecure_channel(bg.address)
        self.search = search_pb2_grpc.SearchServiceStub(self.channel)
        self.docs = documents_pb2_grpc.DocumentServiceStub(self.channel)
        self.redis = redis.Redis.from_url(store_url)
        self.token = common_pb2.WriteToken()

    def upsert(self, docs: list[tuple[str, str, str, dict[str, str]]]) -> None:
        pb = [documents_pb2.Document(id=i, title=t, text=x, metadata=m) for i, t, x, m in docs]
        reply = self.docs.Upsert(documents_pb2.UpsertRequest(documents=pb), timeout=60)
        self.token = reply.write_token

    def request(self, query: str, k: int = 10, **fields: object) -> search_pb2.SearchRequest:
        """A search that sees every write so far (SESSION with the newest token) and
        probes every inverted list, so that a filtered search finds every match (a filter
        narrows the lists probed, it does not widen them)."""
        fields.setdefault("nprobe", self.nlist)
        return search_pb2.SearchRequest(
            query=query,
            k=k,
            consistency=common_pb2.CONSISTENCY_SESSION,
            write_token=self.token,
            **fields,  # type: ignore[arg-type]
        )


RERANK_6 = search_pb2.RerankOptions(enabled=True, depth=6)


def _filter(**conditions: list[str]) -> common_pb2.Filter:
    return common_pb2.Filter(
        must=[common_pb2.FieldCondition(key=k, any_of=v) for k, v in conditions.items()]
    )


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, scifact_dir: Path) -> Iterator[Front]:
    with scifact_stack_with_rerank(tmp_path_factory, scifact_dir, "coverage") as (bg, store, nlist):
        f = Front(bg, store.url, nlist)
        f.upsert(DOCS)
        yield f
        f.channel.close()


def test_a_filter_keeps_only_documents_matching_every_condition(front: Front) -> None:
    unfiltered = front.search.Search(front.request("read a csv file"), timeout=30)
    assert {"csv-go", "nolang"} <= {h.id for h in unfiltered.hits}, "the filter is what narrows"

    py = front.search.Search(
        front.request("read a csv file", filter=_filter(lang=["py"])), timeout=30
    )
    assert {h.id for h in py.hits} == {i for i, m in META.items() if m.get("lang") == "py"}
    assert py.hits[0].id == "csv-py" and py.hits[0].metadata["lang"] == "py"

    both = front.search.Search(
        front.request("read a csv file", filter=_filter(lang=["py", "go"], topic=["csv"])),
        timeout=30,
    )
    assert {h.id for h in both.hits} == {"csv-py", "csv-go"}, "any of a key's values, all keys"

    none = front.search.Search(
        front.request("read a csv file", filter=_filter(lang=["cobol"])), timeout=30
    )
    assert list(none.hits) == [] and not none.partial


def test_a_batch_of_searches_with_different_options_answers_each_by_its_own(
    front: Front,
) -> None:
    requests = [
        front.request("read a csv file", k=2),
        front.request("read a csv file", k=5, filter=_filter(lang=["go"])),
        front.request("parse json", k=3, ids_only=True),
        front.request("read a csv file", k=3, rerank=RERANK_6),
        search_pb2.SearchRequest(query="sha256 hash of bytes", k=1),  # EVENTUAL, no token
        front.request("threads", k=4, filter=_filter(topic=["thread"]), ids_only=True),
    ]
    replies = front.search.BatchSearch(
        search_pb2.BatchSearchRequest(requests=requests), timeout=60
    ).responses
    assert len(replies) == len(requests)
    plain, go, ids_only, reranked, eventual, thread = replies

    assert len(plain.hits) == 2 and plain.hits[0].id == "csv-py" and plain.hits[0].text
    assert {h.id for h in go.hits} == {"csv-go", "json-go"}
    assert all(META[h.id]["lang"] == "go" for h in go.hits)
    assert ids_only.hits[0].id == "json-py"
    assert all(not (h.text or h.title or h.metadata) for h in ids_only.hits)
    assert reranked.reranked and reranked.rerank_depth == 6 and len(reranked.hits) == 3
    assert [h.id for h in reranked.hits] != [] and all(h.text for h in reranked.hits)
    assert not plain.reranked and not go.reranked, "only the one that asked is reranked"
    assert [h.id for h in eventual.hits] == ["hash-py"]
    assert [h.id for h in thread.hits] == ["pool-py"] and not thread.hits[0].text


def test_a_hit_whose_document_was_deleted_after_the_shards_answered_is_dropped(
    front: Front,
) -> None:
    """The document hash goes while the shards still hold the vector (as when a delete
    lands between the shards' answer and the fetch): the hit must not come back. (Not
    for ``ids_only`` without rerank: it fetches no document, by design, so it shows a
    delete once the shards have applied it, milliseconds later.)"""
    front.upsert([("ghost", "csv ghost", "Read a csv file, then vanish.", {"lang": "py"})])
    seen = front.search.Search(front.request("read a csv file, then vanish"), timeout=30)
    assert seen.hits[0].id == "ghost"

    (key,) = [k for k in front.redis.scan_iter(match="doc*ghost") if k.endswith(b"ghost")]
    assert front.redis.delete(key) == 1  # the hash only: no log entry reaches the shards
    for request in (
        front.request("read a csv file, then vanish"),
        front.request(
            "read a csv file, then vanish", rerank=search_pb2.RerankOptions(enabled=True)
        ),
    ):
        reply = front.search.Search(request, timeout=30)
        assert "ghost" not in [h.id for h in reply.hits], request
        assert reply.hits, "the other documents still answer"
    with pytest.raises(grpc.RpcError) as err:
        front.docs.Get(documents_pb2.GetRequest(id="ghost"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]


def test_a_shard_down_gives_a_partial_answer_or_an_error_when_complete_is_required(
    front: Front,
) -> None:
    """Last in the module: it stops shard 1's server."""
    shard = 1
    on_down = sorted(i for i in META if shard_of(i, 2) == shard)
    assert on_down, "the test needs documents on the shard it stops"
    front.bg.run(front.bg.stack.shards[shard][0].server.stop(0))

    request = search_pb2.SearchRequest(query="read a csv file", k=10)
    reply = front.search.Search(request, timeout=10)
    assert reply.partial and list(reply.missing_shards) == [shard]
    assert reply.hits and not set(on_down) & {h.id for h in reply.hits}

    request.require_complete = True
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        front.search.Search(request, timeout=30)
    assert err.value.code() in (  # type: ignore[attr-defined]
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )
    took = time.monotonic() - started
    assert took < 15, f"the gateway's answer, not the client's own deadline ({took:.1f} s)"
    # a batch: every search of it partial the same way, none with an empty OK
    batch = front.search.BatchSearch(
        search_pb2.BatchSearchRequest(
            requests=[search_pb2.SearchRequest(query=q, k=3) for q in ("json", "csv")]
        ),
        timeout=10,
    )
    assert all(r.partial and list(r.missing_shards) == [shard] for r in batch.responses)
