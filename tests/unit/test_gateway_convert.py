"""The gateway's answers to bytes and back: what a client parses is what the pipeline
answered (services/gateway/convert.py).

Each answer is serialised (``SerializeToString``), parsed as a client would
(``FromString``) and read back into the domain objects; the comparison is of whole
objects. Floats are drawn as float32 (the public messages carry ``float``), strings as
any Unicode text (protobuf strings are UTF-8).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrieval.v1 import documents_pb2, search_pb2
from services.common.domain import TokenOrigin, WriteToken
from services.common.errors import InvalidArgument
from services.common.fusion import Fusion, Method, Mode
from services.gateway import convert
from services.gateway.domain import Document, Hit, SearchQuery, SearchResult, Timings, WriteResult

UINT32 = st.integers(0, 2**32 - 1)
F32 = st.floats(width=32, allow_nan=False)
POSITIONS = st.builds(lambda ms, seq: f"{ms}-{seq}", st.integers(0, 2**48), st.integers(0, 2**32))
TOKENS: st.SearchStrategy[WriteToken] = st.dictionaries(UINT32, POSITIONS, max_size=8)
GENERATIONS = st.integers(1, 10**9 - 1).map(lambda n: f"g{n}")
# a token names its generation and epoch, or neither (one built from positions alone)
ORIGINS = st.just(TokenOrigin()) | st.builds(TokenOrigin, GENERATIONS, st.integers(1, 2**64 - 1))
# A stored document always has text (validation.check_documents), so a hit that carries
# one is told apart from an ids_only hit; the public Hit has no version or own id.
DOCUMENTS = st.builds(
    Document,
    id=st.just(""),
    text=st.text(min_size=1),
    title=st.text(),
    metadata=st.dictionaries(st.text(), st.text(), max_size=4),
)


@st.composite
def hits(draw: st.DrawFn) -> Hit:
    hit = Hit(draw(st.text()), draw(F32), draw(UINT32), draw(F32))
    hit.dense_rank, hit.sparse_rank = draw(UINT32), draw(UINT32)
    document = draw(st.none() | DOCUMENTS)
    if document is not None:
        hit.document = Document(hit.id, document.text, document.title, document.metadata)
    return hit


FUSIONS = st.builds(
    Fusion,
    st.sampled_from(list(Method)),
    rrf_k=st.integers(1, 10_000),
    dense_weight=st.floats(0, 1, width=32),
)
RESULTS = st.builds(
    SearchResult,
    hits=st.lists(hits(), max_size=6),
    model=st.text(),
    partial=st.booleans(),
    missing_shards=st.lists(UINT32, max_size=4),
    timings=st.builds(Timings, F32, F32, F32, F32, F32),
    query_truncated=st.booleans(),
    reranked=st.booleans(),
    rerank_depth=UINT32,
    rerank_skipped=st.booleans(),
    rerank_skipped_reason=st.text(),
    embedding_cached=st.booleans(),
    mode=st.sampled_from(list(Mode)),
    fusion=st.none() | FUSIONS,
    sparse_missing_shards=st.lists(UINT32, max_size=4),
    generation=st.just("") | GENERATIONS,
)


def result_from_pb(pb: search_pb2.SearchResponse) -> SearchResult:
    """A client's reading of a SearchResponse as the gateway's domain result."""
    t = pb.timings
    return SearchResult(
        hits=[
            Hit(
                h.id,
                h.score,
                h.shard,
                h.first_stage_score,
                Document(h.id, h.text, h.title, dict(h.metadata)) if h.text else None,
                dense_rank=h.dense_rank,
                sparse_rank=h.sparse_rank,
            )
            for h in pb.hits
        ],
        model=pb.model,
        partial=pb.partial,
        missing_shards=list(pb.missing_shards),
        timings=Timings(t.encode_ms, t.search_ms, t.fetch_ms, t.rerank_ms, t.total_ms),
        query_truncated=pb.query_truncated,
        reranked=pb.reranked,
        rerank_depth=pb.rerank_depth,
        rerank_skipped=pb.rerank_skipped,
        rerank_skipped_reason=pb.rerank_skipped_reason,
        embedding_cached=pb.embedding_cached,
        mode=convert.mode_from_pb(pb.mode) or Mode.DENSE,
        fusion=(
            Fusion(
                Method.RRF if pb.fusion.method == search_pb2.FUSION_METHOD_RRF else Method.WEIGHTED,
                rrf_k=pb.fusion.rrf_k,
                dense_weight=pb.fusion.dense_weight,
            )
            if pb.HasField("fusion")
            else None
        ),
        sparse_missing_shards=list(pb.sparse_missing_shards),
        generation=pb.generation,
    )


@given(RESULTS)
def test_a_search_result_survives_the_wire(result: SearchResult) -> None:
    wire = convert.result_to_pb(result).SerializeToString()
    assert result_from_pb(search_pb2.SearchResponse.FromString(wire)) == result


@given(TOKENS, UINT32, UINT32, ORIGINS)
def test_an_upsert_result_survives_the_wire(
    token: WriteToken, count: int, cut: int, origin: TokenOrigin
) -> None:
    result = WriteResult(token, count, truncated=cut, origin=origin)
    wire = convert.upsert_result_to_pb(result).SerializeToString()
    pb = documents_pb2.UpsertResponse.FromString(wire)
    back = WriteResult(
        convert.token_from_pb(pb.write_token),
        pb.upserted,
        truncated=pb.truncated,
        origin=convert.token_origin_from_pb(pb.write_token),
    )
    assert back == result


@given(TOKENS, UINT32, st.lists(st.text(), max_size=6).map(tuple), ORIGINS)
def test_a_delete_result_survives_the_wire(
    token: WriteToken, count: int, not_found: tuple[str, ...], origin: TokenOrigin
) -> None:
    result = WriteResult(token, count, not_found=not_found, origin=origin)
    wire = convert.delete_result_to_pb(result).SerializeToString()
    pb = documents_pb2.DeleteResponse.FromString(wire)
    back = WriteResult(
        convert.token_from_pb(pb.write_token),
        pb.deleted,
        tuple(pb.not_found),
        origin=convert.token_origin_from_pb(pb.write_token),
    )
    assert back == result


@given(TOKENS, ORIGINS)
def test_a_search_s_write_token_survives_the_wire(token: WriteToken, origin: TokenOrigin) -> None:
    query = SearchQuery("q", 10, write_token=token, token_origin=origin)
    wire = convert.query_to_pb(query).SerializeToString()
    back = convert.query_from_pb(search_pb2.SearchRequest.FromString(wire))
    assert (back.write_token, back.token_origin) == (token, origin)


@pytest.mark.parametrize(
    ("generation", "epoch", "message"),
    [
        ("gen2", 3, "not a generation's name"),
        ("g0", 3, "not a generation's name"),
        ("g2", 0, "come together"),
        ("", 3, "come together"),
    ],
)
def test_a_token_with_a_bad_generation_or_epoch_is_an_invalid_argument(
    generation: str, epoch: int, message: str
) -> None:
    from retrieval.v1 import common_pb2

    token = common_pb2.WriteToken(generation=generation, epoch=epoch)
    with pytest.raises(InvalidArgument, match=message):
        convert.query_from_pb(search_pb2.SearchRequest(query="q", k=3, write_token=token))


@given(st.none() | st.sampled_from(list(Mode)), st.none() | FUSIONS, st.integers(0, 1000))
def test_a_query_s_mode_and_fusion_survive_the_wire(
    mode: Mode | None, fusion: Fusion | None, candidates: int
) -> None:
    query = SearchQuery("q", 10, mode=mode, fusion=fusion, candidates=candidates)
    wire = convert.query_to_pb(query).SerializeToString()
    back = convert.query_from_pb(search_pb2.SearchRequest.FromString(wire))
    assert (back.mode, back.fusion, back.candidates) == (mode, fusion, candidates)


def test_a_client_that_sends_no_mode_gets_the_gateway_s_defaults() -> None:
    back = convert.query_from_pb(search_pb2.SearchRequest(query="q", k=3))
    assert (back.mode, back.fusion, back.candidates) == (None, None, 0)
    # a weight alone means the weighted fusion, a k alone RRF; unset parts take defaults
    req = search_pb2.SearchRequest(query="q", k=3, fusion=search_pb2.Fusion(dense_weight=0.75))
    assert convert.query_from_pb(req).fusion == Fusion(Method.WEIGHTED, dense_weight=0.75)
    req = search_pb2.SearchRequest(query="q", k=3, fusion=search_pb2.Fusion(rrf_k=10))
    assert convert.query_from_pb(req).fusion == Fusion(Method.RRF, rrf_k=10)


@pytest.mark.parametrize(
    ("request_pb", "message"),
    [
        (search_pb2.SearchRequest(query="q", k=3, mode=7), "mode"),  # type: ignore[arg-type]
        (
            search_pb2.SearchRequest(query="q", k=3, fusion=search_pb2.Fusion(method=9)),  # type: ignore[arg-type]
            "fusion method",
        ),
        (
            search_pb2.SearchRequest(query="q", k=3, fusion=search_pb2.Fusion(dense_weight=1.5)),
            "dense_weight",
        ),
        (
            search_pb2.SearchRequest(query="q", k=3, fusion=search_pb2.Fusion(rrf_k=20_000)),
            "rrf_k",
        ),
    ],
)
def test_unknown_modes_and_bad_fusions_are_invalid_arguments(
    request_pb: search_pb2.SearchRequest, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        convert.query_from_pb(request_pb)
