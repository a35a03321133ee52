"""Property-based tests: malformed and extreme requests at every public RPC of the gateway.

One real gateway for the module (real Redis, two real shard servers, the real MiniLM
encoder in the gateway, a real rerank server with a tiny CELI checkpoint, the query cache
on), driven over gRPC as a client would. ``hypothesis`` throws at Search, BatchSearch,
Get, Upsert, Delete (and the health check and reflection): empty, huge and odd-Unicode
texts and ids, k and nprobe up to 2^32-1, unknown consistency values, write tokens with
bad shards and positions, filters with too many or huge conditions, duplicate ids,
"NaN"/"inf" strings where numbers might be parsed, and raw bytes that are not a request
at all. For every one:

* the answer is OK or a status a client can act on, never INTERNAL or UNKNOWN;
* the gateway still serves (its health is SERVING and a plain search answers);
* a rejected write changes nothing stored (a digest of every key in Redis is equal
  before and after), an accepted one reads back as written.

Example counts are bounded (``settings`` below) so the module runs well under a minute
once its stack is up.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from retrieval.v1 import (
    common_pb2,
    documents_pb2,
    documents_pb2_grpc,
    search_pb2,
    search_pb2_grpc,
)
from services.common.limits import LIMITS
from services.gateway.query_cache import KEY_PREFIX
from services.index.keys import SEARCH_LATENCY_KEY
from tests.support.background import BackgroundStack, scifact_stack_with_rerank
from tests.support.rerank import WORDS

# What a client may get back for a request that is wrong or asks too much: each one
# tells it what to do. INTERNAL and UNKNOWN (a bug) are not in it.
ACTIONABLE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # a SESSION position a shard has not applied in time
    grpc.StatusCode.UNAVAILABLE,
}
SEARCH_TIMEOUT_S = 3.0
EXAMPLES = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
SEED_DOCS = [
    (f"seed-{i}", f"{w} title", f"How to {w} a {v} in Python.", {"lang": "py", "n": str(i)})
    for i, (w, v) in enumerate(zip(WORDS, reversed(WORDS), strict=True))
]

# --- strategies -----------------------------------------------------------------------

_chars = st.characters(exclude_categories=["Cs"])  # a proto string cannot hold surrogates
ODD = [
    "",
    " ",
    "\t\n\r ",
    "\x00",
    "\x00abc",
    "\u200b",
    "\ufeff",
    "\u202e evil",
    "a\u0301",
    "\U0010ffff",
    "🙂" * 3,
    "NaN",
    "nan",
    "inf",
    "-inf",
    "1e309",
    "-0",
    "null",
    "{}",
    "doc:{0}:x",
    "{gtr-qcache}",
    "*",
    "../../etc/passwd",
    "'; DROP TABLE docs; --",
    "x" * (LIMITS.max_id_bytes + 1),
    "é" * (LIMITS.max_id_bytes // 2 + 1),
]
HUGE = ["q" * (LIMITS.max_query_bytes + 1), "é" * (LIMITS.max_query_bytes // 2 + 1)]


def _pick(values: list[str]) -> st.SearchStrategy[str]:
    """One of ``values``, drawn by index. Long values are drawn so, or built from their
    length: a strategy holding them made hypothesis render them whole in its repr
    (warnings of 53 and 1,103 kB)."""
    return st.integers(0, len(values) - 1).map(lambda i: values[i])


texts = st.one_of(st.text(_chars, max_size=40), _pick(ODD + HUGE), _pick(WORDS))
ids = st.one_of(st.text(_chars, max_size=20), _pick(ODD), st.sampled_from(["seed-1"]))
uint32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 1000, 1001, 2**32 - 1]))
positions = st.one_of(
    st.sampled_from(
        [
            "",
            "0-0",
            "1-0",
            "0",
            "-1",
            "1-",
            "-1-0",
            "a-b",
            "1-2-3",
            " 1-0",
            "NaN-0",
            "inf",
            "18446744073709551616-0",
            "0-18446744073709551616",
            "\x00",
            "1-0\n",
        ]
    ),
    st.text(_chars, max_size=12),
)
tokens = st.builds(
    lambda ps: common_pb2.WriteToken(
        positions=[common_pb2.ShardPosition(shard=s, position=p) for s, p in ps]
    ),
    st.lists(st.tuples(st.one_of(st.integers(0, 3), uint32), positions), max_size=4),
)
conditions = st.builds(
    lambda key, values: common_pb2.FieldCondition(key=key, any_of=values),
    st.one_of(texts, st.sampled_from(["lang", "n", "x" * (LIMITS.max_key_bytes + 1)])),
    st.one_of(
        st.lists(st.one_of(texts, st.sampled_from(["py", "1"])), max_size=4),
        st.just(["v"] * (LIMITS.max_filter_values + 1)),
        st.just([str(i) for i in range(LIMITS.max_filter_values)]),
    ),
)
filters = st.builds(
    lambda cs: common_pb2.Filter(must=cs),
    st.one_of(
        st.lists(conditions, max_size=3),
        st.lists(conditions, min_size=LIMITS.max_filter_conditions + 1, max_size=40),
    ),
)


def _one_extreme(
    sane: dict[str, st.SearchStrategy[object]], extreme: dict[str, st.SearchStrategy[object]]
) -> st.SearchStrategy[dict[str, object]]:
    """Mostly sane fields (so that accepted requests are exercised too), then one field
    made extreme, or every field extreme at once."""
    one = st.tuples(
        st.fixed_dictionaries(sane),
        st.sampled_from(sorted(extreme)).flatmap(lambda f: st.tuples(st.just(f), extreme[f])),
    ).map(lambda t: {**t[0], t[1][0]: t[1][1]})
    return st.one_of(st.fixed_dictionaries(sane), one, st.fixed_dictionaries(extreme))


sane_texts = st.one_of(_pick(WORDS), st.text(_chars, min_size=1, max_size=30))
search_requests = _one_extreme(
    {
        "query": sane_texts,
        "k": st.integers(1, 20),
        "filter": st.sampled_from(
            [
                common_pb2.Filter(),
                common_pb2.Filter(must=[common_pb2.FieldCondition(key="lang", any_of=["py"])]),
            ]
        ),
        "consistency": st.sampled_from([0, 1, 3]),
        "require_complete": st.booleans(),
        "rerank": st.builds(
            search_pb2.RerankOptions, enabled=st.booleans(), depth=st.sampled_from([0, 20])
        ),
        "nprobe": st.sampled_from([0, 1, 8]),
        "ids_only": st.booleans(),
    },
    {
        "query": texts,
        "k": uint32,
        "filter": filters,
        "consistency": st.integers(0, 6),  # 4.. are values no client knows
        "write_token": tokens,
        "rerank": st.builds(search_pb2.RerankOptions, enabled=st.booleans(), depth=uint32),
        "nprobe": uint32,
    },
).map(lambda fields: search_pb2.SearchRequest(**fields))  # type: ignore[arg-type]
metadata = st.one_of(
    st.dictionaries(texts, texts, max_size=4),
    st.just({f"k{i}": "v" for i in range(LIMITS.max_metadata_keys + 1)}),
    st.just(LIMITS.max_metadata_value_bytes + 1).map(lambda n: {"big": "v" * n}),
)
documents = _one_extreme(
    {
        "id": st.sampled_from([f"prop-{i}" for i in range(8)]),
        "title": sane_texts,
        "text": sane_texts,
        "metadata": st.dictionaries(st.sampled_from(["lang", "n"]), sane_texts, max_size=2),
    },
    {
        "id": ids,
        "title": texts,
        "text": st.one_of(texts, st.just(LIMITS.max_text_bytes + 1).map(lambda n: "t" * n)),
        "metadata": metadata,
    },
).map(lambda fields: documents_pb2.Document(**fields))  # type: ignore[arg-type]
sane_ids = st.sampled_from([f"prop-{i}" for i in range(8)] + ["seed-1", "no-such-doc"])
SEEN: dict[str, set[grpc.StatusCode]] = {}


def _seen(rpc: str, code: grpc.StatusCode) -> None:
    SEEN.setdefault(rpc, set()).add(code)
    event(f"{rpc}: {code.name}")


# --- the stack ---------------------------------------------------------------------------


class Front:
    def __init__(self, bg: BackgroundStack, store_url: str) -> None:
        self.bg = bg
        self.channel = grpc.insecure_channel(
            bg.address,
            options=[("grpc.max_send_message_length", 64 << 20)],
        )
        self.search = search_pb2_grpc.SearchServiceStub(self.channel)
        self.docs = documents_pb2_grpc.DocumentServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.redis = redis.Redis.from_url(store_url)

    def digest(self) -> str:
        """Every stored key and its value (DUMP), but the query cache's entries and the
        gateway's latency report (rewritten every second, for a rollout's pacing)."""
        h = hashlib.sha256()
        for key in sorted(self.redis.scan_iter(count=1000)):
            if key.startswith(KEY_PREFIX.encode()) or key == SEARCH_LATENCY_KEY.encode():
                continue
            h.update(key + b"\x00" + (self.redis.dump(key) or b"") + b"\x00")
        return h.hexdigest()

    def still_serving(self) -> None:
        reply = self.health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        ok = self.search.Search(search_pb2.SearchRequest(query="read a csv file", k=3), timeout=30)
        assert ok.hits, "a plain search still answers"


def _code(call: object) -> grpc.StatusCode:
    """OK, or the status of the error the call raised (which must be actionable)."""
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        assert code in ACTIONABLE, f"{code}: {exc.details()}"  # type: ignore[attr-defined]
        return code  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, scifact_dir: Path) -> Iterator[Front]:
    settings: dict[str, object] = {"query_cache": True, "default_timeout_s": 5.0}
    stack = scifact_stack_with_rerank(tmp_path_factory, scifact_dir, "properties", settings)
    with stack as (bg, store, _):
        f = Front(bg, store.url)
        seed = [
            documents_pb2.Document(id=i, title=t, text=x, metadata=m) for i, t, x, m in SEED_DOCS
        ]
        f.docs.Upsert(documents_pb2.UpsertRequest(documents=seed), timeout=60)
        yield f
        f.channel.close()


# --- the properties ------------------------------------------------------------------------


# Each property test also runs one request of each outcome explicitly (@example), so that
# test_the_gateway_still_serves_after_all_of_it does not hang on what 25 random draws hit.
@EXAMPLES
@example(request=search_pb2.SearchRequest(query="sort a list", k=3))
@example(request=search_pb2.SearchRequest(query="sort a list", k=LIMITS.max_k + 1))
@given(request=search_requests)
def test_search_never_answers_internal(front: Front, request: search_pb2.SearchRequest) -> None:
    reply: list[search_pb2.SearchResponse] = []
    code = _code(lambda: reply.append(front.search.Search(request, timeout=SEARCH_TIMEOUT_S)))
    _seen("Search", code)
    if code is grpc.StatusCode.OK:
        (r,) = reply
        assert len(r.hits) <= request.k
        assert len({h.id for h in r.hits}) == len(r.hits), "no hit twice"
        if request.ids_only:
            assert all(not h.text and not h.title for h in r.hits)


@EXAMPLES
@example(requests=[search_pb2.SearchRequest(query="sort a list", k=3)])
@example(requests=[])
@given(requests=st.one_of(st.lists(search_requests, max_size=4), st.just([])))
def test_batch_search_never_answers_internal(
    front: Front, requests: list[search_pb2.SearchRequest]
) -> None:
    reply: list[search_pb2.BatchSearchResponse] = []
    batch = search_pb2.BatchSearchRequest(requests=requests)
    code = _code(lambda: reply.append(front.search.BatchSearch(batch, timeout=SEARCH_TIMEOUT_S)))
    _seen("BatchSearch", code)
    if code is grpc.StatusCode.OK:
        assert len(reply[0].responses) == len(requests)
    if not requests:
        assert code is grpc.StatusCode.INVALID_ARGUMENT, "an empty batch is refused"


def test_an_oversized_batch_is_refused(front: Front) -> None:
    batch = search_pb2.BatchSearchRequest(
        requests=[search_pb2.SearchRequest(query="x", k=1)] * (LIMITS.max_batch_queries + 1)
    )
    assert _code(lambda: front.search.BatchSearch(batch, timeout=10)) is (
        grpc.StatusCode.INVALID_ARGUMENT
    )


@EXAMPLES
@example(doc_id="seed-1")
@example(doc_id="example-never-stored")
@given(doc_id=st.one_of(ids, sane_ids))
def test_get_never_answers_internal(front: Front, doc_id: str) -> None:
    reply: list[documents_pb2.GetResponse] = []
    code = _code(
        lambda: reply.append(front.docs.Get(documents_pb2.GetRequest(id=doc_id), timeout=10))
    )
    _seen("Get", code)
    if code is grpc.StatusCode.OK:
        assert reply[0].document.id == doc_id


@EXAMPLES
@example(docs=[documents_pb2.Document(id="example-ok", text="A document that is fine.")])
@example(docs=[documents_pb2.Document(id="", text="A document with no id.")])
@given(
    docs=st.one_of(
        st.lists(documents, max_size=4, unique_by=lambda d: d.id),
        st.lists(documents, max_size=4),
        st.lists(documents, min_size=1, max_size=2).map(lambda d: d + d),  # duplicate ids
        st.just(257).map(
            lambda n: [documents_pb2.Document(id=f"many-{i}", text="x") for i in range(n)]
        ),
    )
)
def test_a_rejected_upsert_changes_nothing_and_an_accepted_one_reads_back(
    front: Front, docs: list[documents_pb2.Document]
) -> None:
    before = front.digest()
    code = _code(lambda: front.docs.Upsert(documents_pb2.UpsertRequest(documents=docs), timeout=60))
    _seen("Upsert", code)
    if code is grpc.StatusCode.OK:
        for doc in docs:
            got = front.docs.Get(documents_pb2.GetRequest(id=doc.id), timeout=10).document
            assert (got.title, got.text, dict(got.metadata)) == (
                doc.title,
                doc.text,
                dict(doc.metadata),
            )
    else:
        assert front.digest() == before, f"{code} yet something stored changed"


@EXAMPLES
@example(doc_ids=["example-never-stored"])
@example(doc_ids=[""])
@given(
    doc_ids=st.one_of(
        st.lists(sane_ids, min_size=1, max_size=4, unique=True),
        st.lists(ids, max_size=4),
        st.lists(ids, min_size=1, max_size=2).map(lambda d: d + d),
        st.just(LIMITS.max_delete_ids + 1).map(lambda n: [f"gone-{i}" for i in range(n)]),
    )
)
def test_a_rejected_delete_changes_nothing(front: Front, doc_ids: list[str]) -> None:
    before = front.digest()
    reply: list[documents_pb2.DeleteResponse] = []
    request = documents_pb2.DeleteRequest(ids=doc_ids)
    code = _code(lambda: reply.append(front.docs.Delete(request, timeout=30)))
    _seen("Delete", code)
    if code is grpc.StatusCode.OK:
        assert reply[0].deleted + len(reply[0].not_found) == len(doc_ids)
    else:
        assert front.digest() == before, f"{code} yet something stored changed"


METHODS = [
    "/retrieval.v1.SearchService/Search",
    "/retrieval.v1.SearchService/BatchSearch",
    "/retrieval.v1.DocumentService/Get",
    "/retrieval.v1.DocumentService/Upsert",
    "/retrieval.v1.DocumentService/Delete",
]


@EXAMPLES
@given(method=st.sampled_from(METHODS), raw=st.binary(max_size=64))
def test_bytes_that_are_no_request_never_answer_internal(
    front: Front, method: str, raw: bytes
) -> None:
    before = front.digest()
    call = front.channel.unary_unary(method)
    code = _code(lambda: call(raw, timeout=SEARCH_TIMEOUT_S))
    if code is not grpc.StatusCode.OK:
        assert front.digest() == before, f"{code} yet something stored changed"


@EXAMPLES
@given(
    name=st.one_of(
        st.text(_chars, max_size=30),
        st.sampled_from(["", "retrieval.v1.SearchService", "grpc.health.v1.Health", "."]),
        _pick(ODD),
    )
)
def test_health_and_reflection_never_answer_internal(front: Front, name: str) -> None:
    """The other public services of the gateway: the health check of any service name,
    reflection asked for any symbol or file."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    code = _code(lambda: front.health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5))
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND)
    _seen("Health", code)
    asks = [
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=name),
        reflection_pb2.ServerReflectionRequest(file_by_filename=name),
        reflection_pb2.ServerReflectionRequest(list_services=name),
    ]
    stub = reflection_pb2_grpc.ServerReflectionStub(front.channel)
    replies = list(stub.ServerReflectionInfo(iter(asks), timeout=5))
    assert len(replies) == len(asks)
    for reply in replies:
        if reply.HasField("error_response"):
            assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_the_gateway_still_serves_after_all_of_it(front: Front) -> None:
    """Last in the module: after every example above, the same process still serves,
    and the examples reached both sides of every RPC (accepted and refused)."""
    front.still_serving()
    for rpc in ("Search", "BatchSearch", "Upsert", "Delete"):
        assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= SEEN.get(rpc, set()), (
            rpc,
            SEEN.get(rpc),
        )
    assert {grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND} <= SEEN.get("Get", set())
