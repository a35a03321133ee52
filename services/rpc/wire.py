"""Detect request fields sent with the wrong wire type.

Protobuf parsers keep a known field number sent with the wrong wire type (say a string
where ``k`` is an integer) as an *unknown field* instead of failing. For a server that
is a client bug hidden as a default value (``k`` reads as 0), so we reject it.
Unknown field numbers are still accepted: they come from newer clients (forward
compatibility).
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet


class WireTypeError(ValueError):
    """A known field arrived with a wire type that does not match its declaration."""


def check_wire_types(message: Message, path: str = "") -> None:
    descriptor = message.DESCRIPTOR
    for unknown in UnknownFieldSet(message):
        field = descriptor.fields_by_number.get(unknown.field_number)
        if field is not None:
            raise WireTypeError(
                f"field {path}{field.name} (#{field.number}) has the wrong type on the wire"
            )
    for field, value in message.ListFields():
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        if field.message_type.GetOptions().map_entry:
            continue
        if field.is_repeated:
            for i, item in enumerate(value):
                check_wire_types(item, f"{path}{field.name}[{i}].")
        else:
            check_wire_types(value, f"{path}{field.name}.")
