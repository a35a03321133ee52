"""An HTTP request as the RPC's request message, and a reply message as JSON.

protobuf's own JSON mapping does the work (:mod:`google.protobuf.json_format`, the
canonical mapping, unknown fields refused): the body, the path variables and the query
parameters are put together as one JSON object and parsed once, so every mistake (a
malformed body, an unknown field, a wrong type, a value out of range) is one
INVALID_ARGUMENT whose message names the field, raised before anything runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from services.common import errors
from services.rpc.http.rules import Route, query_fields

JSON_TYPE = "application/json"


def decode_json(body: bytes) -> Any:
    """The JSON value of ``body``: InvalidArgument when it is not UTF-8 or not JSON, or an
    object repeats a key (protobuf's own parser refuses that too). ``NaN`` and
    ``Infinity`` are not JSON (canonical JSON writes them as strings)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.InvalidArgument(f"malformed JSON body: not UTF-8 ({exc.reason})") from None
    try:
        return json.loads(text, object_pairs_hook=_object, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise errors.InvalidArgument(f"malformed JSON body: {exc}") from None


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise errors.InvalidArgument(f"malformed JSON body: duplicate key {key!r}")
        result[key] = value
    return result


def _no_constant(name: str) -> Any:
    raise errors.InvalidArgument(f'malformed JSON body: {name} is not JSON (write "{name}")')


def request_message(
    route: Route,
    path: Mapping[tuple[str, ...], str],
    query: Iterable[tuple[str, str]],
    body: bytes,
) -> Message:
    """The request message of ``route`` from the path's variables, the query string's
    parameters and the body (for a binding with one; empty = ``{}``)."""
    binding = route.binding
    data: dict[str, Any] = {}
    if binding.body:
        value = decode_json(body) if body.strip() else {}
        if binding.body == "*":
            if not isinstance(value, dict):
                raise errors.InvalidArgument(
                    f"the body must be a JSON object ({route.input.full_name})"
                )
            data = value
        else:
            data[binding.body] = value
    for field_path, text in path.items():
        _put(data, route.input, field_path, text, f"path variable {'.'.join(field_path)!r}")
    allowed = {p: f for p, f in query_fields(route.input, binding)}
    for name, text in query:
        field_path = _resolve(route.input, name)
        if field_path not in allowed:
            raise errors.InvalidArgument(
                f"query parameter {name!r} is not a field {route.method} takes from the query"
                + (" (its request is the JSON body)" if binding.body == "*" else "")
            )
        _put(data, route.input, field_path, text, f"query parameter {name!r}")
    message = message_factory.GetMessageClass(route.input)()
    try:
        json_format.ParseDict(data, message, ignore_unknown_fields=False)
    except json_format.ParseError as exc:
        raise errors.InvalidArgument(f"invalid {route.input.full_name}: {exc}") from None
    return message


def _resolve(message: Descriptor, name: str) -> tuple[str, ...]:
    """A query parameter's field path in proto names (each step by its proto or JSON
    name); InvalidArgument for a name the message does not have."""
    path: list[str] = []
    current: Descriptor | None = message
    for step in name.split("."):
        field = _field(current, step) if current is not None else None
        if field is None:
            raise errors.InvalidArgument(
                f"query parameter {name!r}: {message.full_name} has no field {name!r}"
            )
        path.append(field.name)
        current = field.message_type
    return tuple(path)


def _field(message: Descriptor, name: str) -> FieldDescriptor | None:
    field = message.fields_by_name.get(name)
    if field is not None:
        return field
    return next((f for f in message.fields if f.json_name == name), None)


def _put(
    data: dict[str, Any], message: Descriptor, path: tuple[str, ...], text: str, what: str
) -> None:
    """``text`` as the JSON value of the field at ``path`` (a repeated one appended)."""
    node = data
    for step in path[:-1]:
        nested = node.setdefault(step, {})
        if not isinstance(nested, dict):
            raise errors.InvalidArgument(f"{what}: {step!r} is also given as a non-object")
        node = nested
        message = message.fields_by_name[step].message_type
    field = message.fields_by_name[path[-1]]
    value = _scalar(field, text)
    if field.is_repeated:
        node.setdefault(field.name, []).append(value)
    elif field.name in node:
        raise errors.InvalidArgument(f"{what}: field {'.'.join(path)!r} is given twice")
    else:
        node[field.name] = value


def _scalar(field: FieldDescriptor, text: str) -> Any:
    """A query or path string as the JSON value protobuf's parser takes for ``field``:
    ``true``/``false`` for a bool, an enum's number as a number; everything else stays a
    string (canonical JSON takes numbers as strings too), so a bad value is refused by
    the parser naming the field."""
    if field.type == FieldDescriptor.TYPE_BOOL and text in ("true", "false"):
        return text == "true"
    if field.type == FieldDescriptor.TYPE_ENUM and text.lstrip("-").isdigit():
        return int(text)
    return text


def reply_json(route: Route, reply: Message) -> bytes:
    """The reply (or its ``response_body`` field) in canonical JSON: fields by their JSON
    names, defaults left out, 64-bit integers as strings, enums by name."""
    data: Any = json_format.MessageToDict(reply)
    if route.binding.response_body:
        data = data.get(route.output.fields_by_name[route.binding.response_body].json_name)
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
