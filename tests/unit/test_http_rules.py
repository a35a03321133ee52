"""The HTTP rules as the server reads them from the protos, and how a request binds."""

from __future__ import annotations

import pytest

from retrieval.v1 import common_pb2, search_pb2
from services.common import errors
from services.rpc.http.rules import Route, Template, public_routes
from services.rpc.http.transcode import request_message


def route(operation_id: str) -> Route:
    return next(r for r in public_routes() if r.operation_id == operation_id)


def test_the_routes_are_the_annotations_of_the_protos() -> None:
    table = {(r.binding.verb, r.binding.template.text, r.binding.body) for r in public_routes()}
    assert table == {
        ("POST", "/v1/search", "*"),
        ("GET", "/v1/search", ""),
        ("POST", "/v1/search:batch", "*"),
        ("POST", "/v1/documents:upsert", "*"),
        ("POST", "/v1/documents:delete", "*"),
        ("GET", "/v1/documents/{id}", ""),
        ("GET", "/v1/health", ""),
    }


@pytest.mark.parametrize(
    ("template", "path", "values"),
    [
        ("/v1/documents/{id}", "/v1/documents/a%2Fb%20c", {("id",): "a/b c"}),
        ("/v1/documents/{id}", "/v1/documents/doc:1", {("id",): "doc:1"}),
        ("/v1/documents/{id}", "/v1/documents/", None),
        ("/v1/documents/{id}", "/v1/documents/a/b", None),
        ("/v1/search:batch", "/v1/search:batch", {}),
        ("/v1/search:batch", "/v1/search", None),
        ("/v1/search", "/v1/search:batch", None),
        ("/v1/{name=**}", "/v1/a/b%2Fc", {("name",): "a/b/c"}),
    ],
)
def test_a_template_matches_the_raw_path(
    template: str, path: str, values: dict[tuple[str, ...], str] | None
) -> None:
    assert Template.parse(template).match(path) == values


def test_query_parameters_bind_by_proto_or_json_name_nested_by_path() -> None:
    query = [("query", "a b"), ("k", "3"), ("idsOnly", "true"), ("rerank.enabled", "true")]
    query += [("mode", "2"), ("write_token.epoch", "7")]
    message = request_message(route("SearchService_Search_1"), {}, query, b"")
    assert message == search_pb2.SearchRequest(
        query="a b",
        k=3,
        ids_only=True,
        rerank=search_pb2.RerankOptions(enabled=True),
        mode=search_pb2.RETRIEVAL_MODE_SPARSE,
        write_token=common_pb2.WriteToken(epoch=7),
    )


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ([("k", "3"), ("k", "4")], "'k'"),
        ([("filter.must", "x")], "filter.must"),
        ([("x", "1")], "x"),
    ],
)
def test_a_query_parameter_that_cannot_bind_is_invalid_argument(
    query: list[tuple[str, str]], named: str
) -> None:
    with pytest.raises(errors.InvalidArgument, match=named):
        request_message(route("SearchService_Search_1"), {}, query, b"")
