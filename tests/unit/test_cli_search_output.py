"""The CLI's search output says where the query embedding came from, which first stage
and which index generation answered."""

from __future__ import annotations

import pytest

from gtr_client.convert import search_request, search_result
from retrieval.v1 import search_pb2
from services.client import gateway


def _response(cached: bool) -> search_pb2.SearchResponse:
    return search_pb2.SearchResponse(
        hits=[search_pb2.Hit(id="csv.reader", title="csv.reader", text="Read rows.", score=0.5)],
        model="all-MiniLM-L6-v2",
        embedding_cached=cached,
    )


def format_hits(query: str, response: search_pb2.SearchResponse, width: int) -> str:
    """The CLI's table of an answer as the SDK reads it off the wire."""
    return gateway.format_hits(query, search_result(response), width=width)


def test_a_cached_query_embedding_is_said_in_the_header() -> None:
    head = format_hits("read a csv file", _response(True), width=100).splitlines()[0]
    assert "query embedding from the cache" in head and head.endswith(")")


def test_an_encoded_query_says_nothing_of_the_cache() -> None:
    head = format_hits("read a csv file", _response(False), width=100).splitlines()[0]
    assert "cache" not in head and head.endswith("model all-MiniLM-L6-v2)")


def test_the_mode_and_fusion_that_answered_are_said_in_the_header() -> None:
    response = _response(False)
    response.mode = search_pb2.RETRIEVAL_MODE_HYBRID
    response.fusion.method = search_pb2.FUSION_METHOD_WEIGHTED
    response.sparse_missing_shards.append(1)
    head = format_hits("read a csv file", response, width=100).splitlines()[0]
    assert "; hybrid (weighted); model all-MiniLM-L6-v2)" in head
    assert "shards [1] answered dense only" in head


def test_the_index_generation_that_answered_is_said_in_the_header() -> None:
    response = _response(False)
    response.generation = "g2"
    head = format_hits("read a csv file", response, width=100).splitlines()[0]
    assert head.endswith("; model all-MiniLM-L6-v2, generation g2)")


def test_a_sparse_answer_names_no_model() -> None:
    response = _response(False)
    response.model = ""
    response.mode = search_pb2.RETRIEVAL_MODE_SPARSE
    response.generation = "g2"
    head = format_hits("read a csv file", response, width=100).splitlines()[0]
    assert head.endswith("; sparse; query not encoded, generation g2)")


def test_a_skipped_rerank_is_said_with_its_reason() -> None:
    response = _response(False)
    response.rerank_skipped = True
    response.rerank_skipped_reason = "the rerank of 100 candidates did not finish"
    head = format_hits("read a csv file", response, width=100).splitlines()[0]
    assert head.endswith("NOT RERANKED: the rerank of 100 candidates did not finish")
    assert "NOT RERANKED" not in format_hits("read a csv file", _response(False), width=100)


def test_the_fusion_flags_reach_the_request() -> None:
    from services.cli.main import build_parser
    from services.client.gateway import search_query

    args = build_parser().parse_args(
        [
            "search",
            "q",
            "-k",
            "7",
            "--mode",
            "hybrid",
            "--fusion",
            "weighted",
            "--dense-weight",
            "0.25",
            "--rrf-k",
            "10",
            "--candidates",
            "50",
        ]
    )
    request = search_request(
        search_query(
            args.query,
            args.k,
            mode=args.mode,
            fusion=args.fusion,
            rrf_k=args.rrf_k,
            dense_weight=args.dense_weight,
            candidates=args.candidates,
        )
    )
    assert (request.k, request.mode) == (7, search_pb2.RETRIEVAL_MODE_HYBRID)
    assert request.fusion.method == search_pb2.FUSION_METHOD_WEIGHTED
    assert (request.fusion.dense_weight, request.fusion.rrf_k) == (0.25, 10)
    assert request.fusion.candidates == 50
    plain = search_request(search_query("q", 5))
    assert not plain.HasField("fusion") and plain.mode == search_pb2.RETRIEVAL_MODE_UNSPECIFIED


@pytest.mark.parametrize(
    "flags", [["-k", "-1"], ["-k", "99999999999"], ["--depth", "-1"], ["--rrf-k", "-1"]]
)
def test_a_number_no_request_can_carry_is_a_usage_error_not_a_traceback(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli.main import build_parser

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["search", "q", *flags])
    assert done.value.code == 2
    assert "out of range" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_fusion_flags_outside_a_hybrid_search_are_refused(
    mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gateway takes a fusion with mode DENSE or SPARSE and ignores it: the CLI says
    so instead of sending it (exit 2 before any gateway is resolved or called)."""
    from services.cli.main import main

    code = main(
        [
            "search",
            "q",
            "--mode",
            mode,
            "--rrf-k",
            "5",
            "--candidates",
            "20",
            "--gateway",
            "127.0.0.1:1",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert f"--rrf-k, --candidates: only a hybrid search fuses, not --mode {mode}" in err
