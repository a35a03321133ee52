"""Validation of public requests: every rule rejects with a message naming the field."""

from __future__ import annotations

import pytest

from retrieval.v1 import common_pb2, documents_pb2, search_pb2
from services.common.errors import InvalidArgument
from services.common.limits import Limits
from services.gateway import convert, validation
from services.gateway.domain import Consistency, Document, FieldCondition, SearchQuery

LIMITS = Limits()


def _q(**kw: object) -> SearchQuery:
    base: dict[str, object] = {"text": "read a csv file", "k": 10}
    base.update(kw)
    return SearchQuery(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        (_q(text=""), "query: must not be empty"),
        (_q(text="   \n"), "query: must not be empty"),
        (_q(text="x" * 9000), "query: 9000 bytes"),
        (_q(text="\ud800"), "not valid UTF-8"),
        (_q(k=0), "k: 0 is out of range 1..1000"),
        (_q(k=100000), "k: 100000 is out of range"),
        (_q(nprobe=10**6), "nprobe"),
        (_q(consistency=Consistency.SESSION), "write_token: required"),
        (_q(write_token={7: "1-0"}), "shard 7 does not exist"),
        (_q(filter=(FieldCondition("", ("a",)),)), "filter.must[0].key"),
        (_q(filter=(FieldCondition("lang", ()),)), "filter.must[0].any_of"),
        (_q(rerank=True, rerank_depth=3), "rerank.depth"),
    ],
)
def test_bad_queries_are_rejected(query: SearchQuery, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=None) as err:
        validation.check_query(query, LIMITS, num_shards=2)
    assert needle in err.value.message


def test_good_query_passes() -> None:
    validation.check_query(
        _q(consistency=Consistency.SESSION, write_token={1: "5-0"}, rerank=True, rerank_depth=50),
        LIMITS,
        num_shards=2,
    )


def test_batch_limits() -> None:
    with pytest.raises(InvalidArgument, match=r"a batch takes 1\.\.64"):
        validation.check_batch([], LIMITS, 1)
    with pytest.raises(InvalidArgument, match=r"a batch takes 1\.\.64"):
        validation.check_batch([_q()] * 65, LIMITS, 1)
    with pytest.raises(InvalidArgument, match=r"requests\[1\].k"):
        validation.check_batch([_q(), _q(k=0)], LIMITS, 1)


def test_a_batch_answers_at_most_ten_thousand_hits() -> None:
    """64 queries at k=1000 (64,000 hits, 6.8 MB of stdlib documents) used to pass."""
    with pytest.raises(InvalidArgument, match=r"k summed over the batch: 64000, at most 10000"):
        validation.check_batch([_q(k=1000)] * 64, LIMITS, 1)
    with pytest.raises(InvalidArgument, match=r"10001, at most 10000"):
        validation.check_batch([_q(k=1000)] * 10 + [_q(k=1)], LIMITS, 1)
    validation.check_batch([_q(k=1000)] * 10, LIMITS, 1)
    validation.check_batch([_q(k=156)] * 64, LIMITS, 1)


@pytest.mark.parametrize(
    ("docs", "needle"),
    [
        ([], "documents: 0 given"),
        ([Document("a", "t")] * 257, "documents: 257 given"),
        ([Document("", "t")], "documents[0].id: must not be empty"),
        ([Document("a\x00b", "t")], "control characters"),
        ([Document("x" * 300, "t")], "at most 256"),
        ([Document("a", "t"), Document("a", "u")], "appears twice"),
        ([Document("a", "  ")], "documents[0].text: must not be empty"),
        ([Document("a", "t", metadata={str(i): "v" for i in range(33)})], "33 keys"),
    ],
)
def test_bad_documents_are_rejected(docs: list[Document], needle: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validation.check_documents(docs, LIMITS)
    assert needle in err.value.message


def test_ids_rules() -> None:
    with pytest.raises(InvalidArgument, match="appears twice"):
        validation.check_ids(["a", "a"], LIMITS)
    with pytest.raises(InvalidArgument, match=r"takes 1\.\.1024"):
        validation.check_ids([], LIMITS)


@pytest.mark.parametrize(
    ("doc_id", "message"),
    [("", "id: must not be empty"), ("a" * 300, "id: 300 bytes, at most 256 allowed")],
)
def test_a_get_id_is_named_id_not_id_0(doc_id: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validation.check_id(doc_id, LIMITS)
    assert err.value.message == message


def test_search_request_round_trip() -> None:
    query = SearchQuery(
        text="q",
        k=7,
        filter=(FieldCondition("lang", ("en", "de")),),
        consistency=Consistency.SESSION,
        write_token={0: "12-0", 3: "15-2"},
        require_complete=True,
        rerank=True,
        rerank_depth=40,
        nprobe=16,
        ids_only=True,
    )
    assert convert.query_from_pb(convert.query_to_pb(query)) == query


def test_unspecified_consistency_is_eventual() -> None:
    assert convert.query_from_pb(search_pb2.SearchRequest(query="q", k=1)).consistency is (
        Consistency.EVENTUAL
    )


def test_duplicate_shard_in_token_is_rejected() -> None:
    token = common_pb2.WriteToken(
        positions=[common_pb2.ShardPosition(shard=1), common_pb2.ShardPosition(shard=1)]
    )
    with pytest.raises(InvalidArgument, match="appears twice"):
        convert.token_from_pb(token)


def test_document_round_trip() -> None:
    """Through the wire bytes and back, each field in its own proto field (a round trip
    alone would not see title and text swapped both ways)."""
    doc = Document("id-1", "the text", "the title", {"lang": "en", "ü": "ß"})
    wire = convert.document_to_pb(doc).SerializeToString()
    parsed = documents_pb2.Document.FromString(wire)
    assert (parsed.id, parsed.title, parsed.text) == ("id-1", "the title", "the text")
    assert dict(parsed.metadata) == {"lang": "en", "ü": "ß"}
    assert convert.document_from_pb(parsed) == doc
    bare = Document("id-2", "only text")
    assert (
        convert.document_from_pb(
            documents_pb2.Document.FromString(convert.document_to_pb(bare).SerializeToString())
        )
        == bare
    )


def test_an_empty_batch_is_refused_before_the_generation_is_consulted() -> None:
    """The pipeline reads the batch's newest token epoch before validating it (a newer one
    re-reads the generations alias): an empty batch must still be the clear
    INVALID_ARGUMENT, not a failure of that step."""
    import asyncio
    from typing import Any

    from services.gateway.generation_parts import Bundle
    from services.gateway.generations import GenerationSource
    from services.gateway.pipeline import SearchPipeline

    class Shards:
        num_shards = 2
        model_name = "unused"

    part: Any = Shards()
    pipeline = SearchPipeline(GenerationSource.fixed(Bundle("g1", part, part, part, part, part)))
    with pytest.raises(InvalidArgument, match=r"a batch takes 1\.\.64"):
        asyncio.run(pipeline.search_batch([], timeout=5))


def test_fusion_parameters_need_a_hybrid_mode_as_resolved() -> None:
    """The mode a query that names none gets (--default-mode) decides, not only its own."""
    from services.common.fusion import Fusion, Method, Mode

    rrf = _q(fusion=Fusion(Method.RRF))
    with pytest.raises(InvalidArgument, match=r"^fusion: .* mode is sparse$|^fusion: "):
        validation.check_query(_q(mode=Mode.SPARSE, fusion=Fusion()), LIMITS, 1)
    with pytest.raises(InvalidArgument, match=r"mode is dense \(the gateway's default"):
        validation.check_query(rrf, LIMITS, 1, default_mode=Mode.DENSE)
    with pytest.raises(InvalidArgument, match=r"^requests\[0\]\.fusion\.candidates: "):
        validation.check_batch([_q(candidates=20)], LIMITS, 1, Mode.SPARSE)
    validation.check_query(rrf, LIMITS, 1, default_mode=Mode.HYBRID)
    validation.check_query(_q(mode=Mode.HYBRID, candidates=20), LIMITS, 1, default_mode=Mode.DENSE)
    validation.check_query(_q(), LIMITS, 1, default_mode=Mode.SPARSE)


def test_every_public_limit_is_named_in_the_protos() -> None:
    """Issue #33 point 5: each limit of services/common/limits.py that applies to a public
    request is written, by name and value, in the .proto comments a client reads."""
    import dataclasses
    from pathlib import Path

    protos = Path(__file__).resolve().parents[2] / "protos" / "retrieval" / "v1"
    text = " ".join(
        (protos / name).read_text() for name in ("search.proto", "documents.proto", "common.proto")
    )
    internal = {"max_shard_queries": "query vectors per gateway-to-shard call, not a request's"}
    for field in dataclasses.fields(Limits):
        if field.name in internal:
            continue
        assert (
            f"({field.name}" in text
            or f" {field.name})" in text
            or (f"{field.name};" in text or f"{field.name}," in text)
        ), field.name
