"""The gateway's answers to bytes and back: what a client parses is what the pipeline
answered (services/gateway/convert.py).

Each answer is serialised (``SerializeToString``), parsed as a client would
(``FromString``) and read back into the domain objects; the comparison is of whole
objects. Floats are drawn as float32 (the public messages carry ``float``), strings as
any Unicode text (protobuf strings are UTF-8).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from retrieval.v1 import documents_pb2, search_pb2
from services.common.domain import WriteToken
from services.gateway import convert
from services.gateway.domain import Document, Hit, SearchResult, Timings, WriteResult

UINT32 = st.integers(0, 2**32 - 1)
F32 = st.floats(width=32, allow_nan=False)
POSITIONS = st.builds(lambda ms, seq: f"{ms}-{seq}", st.integers(0, 2**48), st.integers(0, 2**32))
TOKENS: st.SearchStrategy[WriteToken] = st.dictionaries(UINT32, POSITIONS, max_size=8)
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
    document = draw(st.none() | DOCUMENTS)
    if document is not None:
        hit.document = Document(hit.id, document.text, document.title, document.metadata)
    return hit


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
    )


@given(RESULTS)
def test_a_search_result_survives_the_wire(result: SearchResult) -> None:
    wire = convert.result_to_pb(result).SerializeToString()
    assert result_from_pb(search_pb2.SearchResponse.FromString(wire)) == result


@given(TOKENS, UINT32, UINT32)
def test_an_upsert_result_survives_the_wire(token: WriteToken, count: int, cut: int) -> None:
    result = WriteResult(token, count, truncated=cut)
    wire = convert.upsert_result_to_pb(result).SerializeToString()
    pb = documents_pb2.UpsertResponse.FromString(wire)
    back = WriteResult(convert.token_from_pb(pb.write_token), pb.upserted, truncated=pb.truncated)
    assert back == result


@given(TOKENS, UINT32, st.lists(st.text(), max_size=6).map(tuple))
def test_a_delete_result_survives_the_wire(
    token: WriteToken, count: int, not_found: tuple[str, ...]
) -> None:
    result = WriteResult(token, count, not_found=not_found)
    wire = convert.delete_result_to_pb(result).SerializeToString()
    pb = documents_pb2.DeleteResponse.FromString(wire)
    back = WriteResult(convert.token_from_pb(pb.write_token), pb.deleted, tuple(pb.not_found))
    assert back == result
