"""The SDK's types ↔ the wire contract (gtr_client/convert.py): every field of an answer
lands in the typed result, every search option in the request, and what the SDK sends
and reads back (documents, write tokens, fusion) survives the round trip."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gtr_client import (
    Consistency,
    Document,
    Fusion,
    FusionMethod,
    Mode,
    Query,
    WriteToken,
    convert,
)
from retrieval.v1 import common_pb2, documents_pb2, search_pb2

text = st.text(max_size=20)
uint = st.integers(min_value=0, max_value=2**32 - 1)
# float32 values: what the wire carries
f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
metadata = st.dictionaries(st.text(min_size=1, max_size=8), text, max_size=3)
positions = st.dictionaries(
    st.integers(0, 63),
    st.tuples(st.integers(0, 2**63), st.integers(0, 2**63)).map(lambda p: f"{p[0]}-{p[1]}"),
    max_size=4,
)
tokens = st.builds(
    WriteToken, positions, st.sampled_from(["", "g1", "g2"]), st.integers(0, 2**64 - 1)
)
fusions = st.builds(
    Fusion,
    st.sampled_from([None, *FusionMethod]),
    uint,
    st.one_of(st.none(), f32),
    uint,
)


@given(st.builds(Document, text, text, text, metadata))
def test_a_document_survives_the_round_trip(doc: Document) -> None:
    assert convert.document_from_pb(convert.document_to_pb(doc)) == doc


@given(tokens)
def test_a_write_token_survives_the_round_trip(token: WriteToken) -> None:
    assert convert.token_from_pb(convert.token_to_pb(token)) == token


@given(fusions)
def test_a_fusion_survives_the_round_trip(fusion: Fusion) -> None:
    assert convert.fusion_from_pb(convert.fusion_to_pb(fusion)) == fusion


def test_a_mapping_is_a_document_and_a_misspelt_field_is_refused() -> None:
    pb = convert.document_to_pb({"_id": "d1", "text": "x", "metadata": {"year": 2024}})
    assert (pb.id, pb.text, pb.title, dict(pb.metadata)) == ("d1", "x", "", {"year": "2024"})
    with pytest.raises(TypeError, match="txt"):
        convert.document_to_pb({"id": "d1", "txt": "x"})


hits = st.builds(
    search_pb2.Hit,
    id=text,
    score=f32,
    first_stage_score=f32,
    title=text,
    text=text,
    metadata=metadata,
    shard=uint,
    dense_rank=uint,
    sparse_rank=uint,
)
responses = st.builds(
    search_pb2.SearchResponse,
    hits=st.lists(hits, max_size=3),
    partial=st.booleans(),
    missing_shards=st.lists(uint, max_size=3),
    model=text,
    timings=st.builds(
        search_pb2.StageTimings,
        encode_ms=f32,
        search_ms=f32,
        fetch_ms=f32,
        rerank_ms=f32,
        total_ms=f32,
    ),
    query_truncated=st.booleans(),
    reranked=st.booleans(),
    rerank_depth=uint,
    rerank_skipped=st.booleans(),
    rerank_skipped_reason=text,
    embedding_cached=st.booleans(),
    mode=st.sampled_from(list(search_pb2.RetrievalMode.values())),
    fusion=st.one_of(st.none(), fusions.map(convert.fusion_to_pb)),
    sparse_missing_shards=st.lists(uint, max_size=3),
    generation=text,
)


@given(responses)
def test_every_field_of_an_answer_lands_in_the_typed_result(pb: search_pb2.SearchResponse) -> None:
    result = convert.search_result(pb)
    assert len(result) == len(pb.hits) and result.ids == [h.id for h in pb.hits]
    for hit, h in zip(result, pb.hits, strict=True):
        assert (hit.id, hit.score, hit.first_stage_score) == (h.id, h.score, h.first_stage_score)
        assert (hit.title, hit.text, dict(hit.metadata), hit.shard) == (
            h.title,
            h.text,
            dict(h.metadata),
            h.shard,
        )
        assert hit.dense_rank == (h.dense_rank or None)  # 0: not in that list
        assert hit.sparse_rank == (h.sparse_rank or None)
    assert result.partial == pb.partial
    assert list(result.missing_shards) == list(pb.missing_shards)
    assert list(result.sparse_missing_shards) == list(pb.sparse_missing_shards)
    assert result.model == (pb.model or None)  # "": a sparse search, not encoded
    assert result.generation == pb.generation
    assert result.mode == {1: Mode.DENSE, 2: Mode.SPARSE, 3: Mode.HYBRID}.get(pb.mode)
    if pb.HasField("fusion"):
        assert result.fusion == convert.fusion_from_pb(pb.fusion)
    else:
        assert result.fusion is None
    t = pb.timings
    assert (
        result.timings.encode_ms,
        result.timings.search_ms,
        result.timings.fetch_ms,
        result.timings.rerank_ms,
        result.timings.total_ms,
    ) == (t.encode_ms, t.search_ms, t.fetch_ms, t.rerank_ms, t.total_ms)
    assert (result.query_truncated, result.reranked, result.rerank_depth) == (
        pb.query_truncated,
        pb.reranked,
        pb.rerank_depth,
    )
    assert result.rerank_skipped == pb.rerank_skipped
    if pb.rerank_skipped:
        assert result.rerank_skipped_reason == (pb.rerank_skipped_reason or "not reranked")
    assert result.embedding_cached == pb.embedding_cached
    json.dumps(result.to_dict())  # plain values only


queries = st.builds(
    Query,
    text,
    k=uint,
    mode=st.sampled_from([None, *Mode]),
    fusion=st.one_of(st.none(), fusions),
    filter=st.one_of(
        st.none(),
        st.dictionaries(
            st.text(min_size=1, max_size=5), st.one_of(text, st.lists(text, max_size=3))
        ),
    ),
    consistency=st.sampled_from([None, *Consistency]),
    write_token=st.one_of(st.none(), tokens),
    require_complete=st.booleans(),
    rerank=st.booleans(),
    rerank_depth=uint,
    nprobe=uint,
    ids_only=st.booleans(),
)


@given(queries)
def test_every_search_option_reaches_the_request(query: Query) -> None:
    pb = convert.search_request(query)
    assert (pb.query, pb.k, pb.nprobe) == (query.text, query.k, query.nprobe)
    assert (pb.require_complete, pb.ids_only) == (query.require_complete, query.ids_only)
    consistency = query.consistency
    if consistency is None and query.write_token is not None:
        consistency = Consistency.SESSION  # a token alone asks to read its writes
    expected = {
        None: common_pb2.CONSISTENCY_UNSPECIFIED,
        Consistency.EVENTUAL: common_pb2.CONSISTENCY_EVENTUAL,
        Consistency.SESSION: common_pb2.CONSISTENCY_SESSION,
        Consistency.STRONG: common_pb2.CONSISTENCY_STRONG,
    }
    assert pb.consistency == expected[consistency]
    if query.write_token is None:
        assert not pb.HasField("write_token")
    else:
        assert convert.token_from_pb(pb.write_token) == query.write_token
    assert pb.rerank.enabled == query.rerank and pb.rerank.depth == query.rerank_depth
    modes = {None: 0, Mode.DENSE: 1, Mode.SPARSE: 2, Mode.HYBRID: 3}
    assert pb.mode == modes[query.mode]
    if query.fusion is None:
        assert not pb.HasField("fusion")  # unset: the gateway's default
    else:
        assert convert.fusion_from_pb(pb.fusion) == query.fusion
    wanted = {
        key: [values] if isinstance(values, str) else list(values)
        for key, values in (query.filter or {}).items()
    }
    assert {c.key: list(c.any_of) for c in pb.filter.must} == wanted


def test_results_of_writes_carry_their_counts_and_tokens() -> None:
    token = common_pb2.WriteToken(
        positions=[common_pb2.ShardPosition(shard=1, position="5-0")], generation="g2", epoch=2
    )
    up = convert.upsert_result(
        documents_pb2.UpsertResponse(write_token=token, upserted=3, truncated=1)
    )
    assert (up.upserted, up.truncated, up.write_token) == (3, 1, WriteToken({1: "5-0"}, "g2", 2))
    gone = convert.delete_result(
        documents_pb2.DeleteResponse(write_token=token, deleted=1, not_found=["x"])
    )
    assert (gone.deleted, gone.not_found) == (1, ("x",))
