"""docs/openapi.json against the protos: a valid OpenAPI 3 document that has an operation
for every HTTP rule the server routes, and every field of every request and response
message in its schema. (That it is what ``scripts/gen_protos.py`` generates now is
``tests/unit/test_generated_code.py``'s check.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from openapi_spec_validator import validate

from services.rpc.http.rules import Route, public_routes, query_fields

ROOT = Path(__file__).resolve().parents[2]
ROUTES = public_routes()


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return json.loads((ROOT / "docs" / "openapi.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def schema_of(doc: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    name = ref["$ref"].removeprefix("#/components/schemas/")
    return doc["components"]["schemas"][name]  # type: ignore[no-any-return]


def test_the_document_is_valid_openapi_3(doc: dict[str, Any]) -> None:
    validate(doc)
    assert doc["openapi"].startswith("3.")


def test_every_route_is_an_operation_and_nothing_else_is(doc: dict[str, Any]) -> None:
    routed = {(r.binding.template.text, r.binding.verb.lower()): r.operation_id for r in ROUTES}
    documented = {
        (path, verb): op["operationId"]
        for path, ops in doc["paths"].items()
        for verb, op in ops.items()
    }
    assert documented == routed
    rpcs = {(r.service, r.method) for r in ROUTES}
    assert {m.split(".")[-1] for _, m in rpcs} >= {
        "Search",
        "BatchSearch",
        "Upsert",
        "Delete",
        "Get",
        "Check",
    }


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.operation_id)
def test_every_field_a_route_takes_is_in_its_operation(doc: dict[str, Any], route: Route) -> None:
    op = doc["paths"][route.binding.template.text][route.binding.verb.lower()]
    params = {(p["in"], p["name"]) for p in op.get("parameters", [])}
    for variable in route.binding.template.variables:
        assert ("path", ".".join(variable.field_path)) in params
    for path, _field in query_fields(route.input, route.binding):
        assert ("query", ".".join(path)) in params
    if route.binding.body == "*":
        body = schema_of(doc, op["requestBody"]["content"]["application/json"]["schema"])
        assert set(body["properties"]) == {f.json_name for f in route.input.fields}
    else:
        assert "requestBody" not in op
        named = {name.split(".")[0] for _, name in params}
        # a field no query can carry (a map, a repeated message, a message holding only
        # those: a search's filter) needs a binding with a body
        for field in route.input.fields:
            if field.name not in named:
                assert field.type == FieldDescriptor.TYPE_MESSAGE, field.name
                assert carried_by_a_body(route), field.name
    reply = op["responses"]["200"]["content"]["application/json"]["schema"]
    assert reply == {"$ref": f"#/components/schemas/{route.output.full_name}"}
    assert op["responses"]["default"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/google.rpc.Status"
    }


def carried_by_a_body(route: Route) -> bool:
    return any(
        r.binding.body == "*"
        for r in ROUTES
        if (r.service, r.method) == (route.service, route.method)
    )


def test_every_message_schema_has_exactly_its_fields(doc: dict[str, Any]) -> None:
    pool = descriptor_pool.Default()
    reached: set[str] = set()

    def walk(message: Descriptor) -> None:
        if message.full_name in reached or message.GetOptions().map_entry:
            return
        reached.add(message.full_name)
        for field in message.fields:
            if field.message_type is not None:
                walk(field.message_type)
                if field.message_type.GetOptions().map_entry:
                    walk(field.message_type.fields_by_name["value"].message_type or message)

    for route in ROUTES:
        if route.binding.body == "*":  # a request without a body is its parameters
            walk(route.input)
        walk(route.output)
    schemas = doc["components"]["schemas"]
    assert reached <= set(schemas)
    for name in reached:
        message = pool.FindMessageTypeByName(name)
        assert set(schemas[name]["properties"]) == {f.json_name for f in message.fields}, name
        assert schemas[name]["additionalProperties"] is False, "unknown fields are refused"
