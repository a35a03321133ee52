"""Which HTTP request reaches which RPC: the ``google.api.http`` rules of the protos.

A rule (``option (google.api.http) = {post: "/v1/search" body: "*"}``) names a verb, a
path template and where the request message comes from, as gRPC's HTTP/JSON transcoding
defines it (``google/api/http.proto``):

- path variables (``{id}``: one segment, percent-decoded; ``{name=**}``: the rest of the
  path) set the fields they name;
- ``body: "*"``: the JSON body is the whole request message (no query parameters);
  ``body: "field"``: the body is that field, the other fields may come from the query;
  no body: every field not bound by the path may come from the query string, scalar
  fields only (``k=3``, nested ones by their path, ``rerank.enabled=true``; a repeated
  one by repeating it).

The rules are read from the descriptors, so the server's route table
(:mod:`services.rpc.http.server`) and the OpenAPI document (:mod:`services.rpc.http.openapi`)
come from the same annotations and cannot disagree. What the annotations cannot say lives
here too: the health check (gRPC's own ``grpc.health.v1.Health``, a proto that is not
ours) is ``GET /v1/health``.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from google.api import annotations_pb2, http_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor

# The verbs an HttpRule may name (its ``pattern`` oneof), in the rule's field names.
VERBS = ("get", "put", "post", "delete", "patch")
HEALTH_PATH = "/v1/health"


@dataclass(frozen=True)
class Variable:
    """A path variable: the field it sets (``("id",)``) and whether it takes the rest of
    the path (``**``) or one segment."""

    field_path: tuple[str, ...]
    rest: bool = False


Segment = str | Variable


@dataclass(frozen=True)
class Template:
    """A parsed path template: literal segments and variables, and the custom verb after
    the last segment (``/v1/search:batch``: verb ``batch``)."""

    text: str
    segments: tuple[Segment, ...]
    verb: str = ""

    @classmethod
    def parse(cls, text: str) -> Template:
        """``text`` as gRPC transcoding writes it; ValueError for what this server does not
        support (unnamed wildcards, a ``**`` before the last segment, nested variables)."""
        if not text.startswith("/"):
            raise ValueError(f"path template {text!r} must start with '/'")
        path, verb = text, ""
        last = text.rsplit("/", 1)[-1]
        if ":" in last and "}" not in last.split(":", 1)[1]:
            path, verb = text[: -len(last)] + last.split(":", 1)[0], last.split(":", 1)[1]
        segments: list[Segment] = []
        for i, part in enumerate(path[1:].split("/")):
            if part.startswith("{") and part.endswith("}"):
                name, _, pattern = part[1:-1].partition("=")
                if pattern not in ("", "*", "**"):
                    raise ValueError(f"path template {text!r}: unsupported pattern {pattern!r}")
                if pattern == "**" and i != path[1:].count("/"):
                    raise ValueError(f"path template {text!r}: '**' only as the last segment")
                segments.append(Variable(tuple(name.split(".")), rest=pattern == "**"))
            elif not part or any(c in part for c in "{}*"):
                raise ValueError(f"path template {text!r}: unsupported segment {part!r}")
            else:
                segments.append(part)
        return cls(text, tuple(segments), verb)

    @property
    def variables(self) -> list[Variable]:
        return [s for s in self.segments if isinstance(s, Variable)]

    def match(self, raw_path: str) -> dict[tuple[str, ...], str] | None:
        """The variables' values when ``raw_path`` (the request's path as sent, still
        percent-encoded, without its query) matches; None when it does not. A one-segment
        variable is percent-decoded whole (``a%2Fb`` is ``a/b``); a ``**`` variable keeps
        its slashes. UnicodeDecodeError for a value that is not UTF-8."""
        if self.verb:
            if not raw_path.endswith(":" + self.verb):
                return None
            raw_path = raw_path[: -len(self.verb) - 1]
        parts = raw_path[1:].split("/") if raw_path.startswith("/") else None
        if parts is None:
            return None
        values: dict[tuple[str, ...], str] = {}
        for i, segment in enumerate(self.segments):
            if isinstance(segment, Variable) and segment.rest:
                rest = parts[i:]
                if not rest or not all(rest):
                    return None
                values[segment.field_path] = "/".join(_decode(p) for p in rest)
                return values
            if i >= len(parts):
                return None
            if isinstance(segment, Variable):
                if not parts[i]:
                    return None
                values[segment.field_path] = _decode(parts[i])
            elif parts[i] != segment:
                return None
        return values if len(parts) == len(self.segments) else None


def _decode(part: str) -> str:
    return urllib.parse.unquote(part, errors="strict")


@dataclass(frozen=True)
class Binding:
    """One HTTP binding of an RPC: its verb (``GET``), path template, and ``body`` (``*``,
    a field's name, or empty: no body) and ``response_body`` (empty: the whole reply)."""

    verb: str
    template: Template
    body: str = ""
    response_body: str = ""


def bindings(rule: http_pb2.HttpRule) -> list[Binding]:
    """The rule's binding and its ``additional_bindings`` (one level, as the spec allows)."""

    def one(r: http_pb2.HttpRule) -> Binding:
        kind = r.WhichOneof("pattern")
        if kind not in VERBS:
            raise ValueError(f"HTTP rule {r.selector or ''}: unsupported pattern {kind!r}")
        return Binding(kind.upper(), Template.parse(getattr(r, kind)), r.body, r.response_body)

    return [one(rule), *(one(extra) for extra in rule.additional_bindings)]


@dataclass(frozen=True)
class Route:
    """An RPC reached over HTTP: its service and method, one binding, and the request
    and response messages' descriptors. ``index`` counts the RPC's bindings (0: the rule's
    own, 1.. its additional ones)."""

    service: str
    method: str
    binding: Binding
    input: Descriptor
    output: Descriptor
    index: int = 0

    @property
    def grpc_method(self) -> str:
        """The gRPC method's full name as the server sees it: ``/pkg.Service/Method``."""
        return f"/{self.service}/{self.method}"

    @property
    def operation_id(self) -> str:
        """``SearchService_Search`` (``_1``, ``_2``... for the additional bindings)."""
        name = f"{self.service.rsplit('.', 1)[-1]}_{self.method}"
        return f"{name}_{self.index}" if self.index else name


def service_routes(service: ServiceDescriptor) -> list[Route]:
    """Every binding of every method of ``service`` that has a ``google.api.http`` rule."""
    routes = []
    for method in service.methods:
        options = method.GetOptions()
        if not options.HasExtension(annotations_pb2.http):
            continue
        rule = options.Extensions[annotations_pb2.http]
        for index, binding in enumerate(bindings(rule)):
            routes.append(
                Route(
                    service.full_name,
                    method.name,
                    binding,
                    method.input_type,
                    method.output_type,
                    index,
                )
            )
    return routes


def health_route(health_file: object) -> Route:
    """``GET /v1/health`` (``?service=NAME`` for one service) → gRPC health's ``Check``,
    from ``grpc_health/v1/health.proto``'s file descriptor."""
    service = health_file.services_by_name["Health"]  # type: ignore[attr-defined]
    method = service.methods_by_name["Check"]
    return Route(
        service.full_name,
        "Check",
        Binding("GET", Template.parse(HEALTH_PATH)),
        method.input_type,
        method.output_type,
    )


def public_routes() -> list[Route]:
    """The gateway's routes: the public services' annotated methods and the health check."""
    from grpc_health.v1 import health_pb2

    from retrieval.v1 import documents_pb2, search_pb2

    return [
        *service_routes(search_pb2.DESCRIPTOR.services_by_name["SearchService"]),
        *service_routes(documents_pb2.DESCRIPTOR.services_by_name["DocumentService"]),
        health_route(health_pb2.DESCRIPTOR),
    ]


def bound_fields(binding: Binding) -> set[tuple[str, ...]]:
    """The field paths the path sets (not to be taken from the query or the body)."""
    return {v.field_path for v in binding.template.variables}


def query_fields(
    message: Descriptor, binding: Binding
) -> Iterator[tuple[tuple[str, ...], FieldDescriptor]]:
    """The fields a request may set in its query string: none with ``body: "*"``;
    otherwise every scalar field (enums and repeated scalars included) not bound by the
    path or the body, and those of nested singular messages by their path. Maps and
    repeated messages cannot be written as query parameters."""
    if binding.body == "*":
        return
    skip = bound_fields(binding) | ({(binding.body,)} if binding.body else set())
    yield from _scalars(message, (), skip, ())


def _scalars(
    message: Descriptor,
    prefix: tuple[str, ...],
    skip: set[tuple[str, ...]],
    seen: Sequence[str],
) -> Iterator[tuple[tuple[str, ...], FieldDescriptor]]:
    for field in message.fields:
        path = (*prefix, field.name)
        if path in skip:
            continue
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            yield path, field
        elif not field.is_repeated and field.message_type.full_name not in seen:
            yield from _scalars(field.message_type, path, skip, [*seen, message.full_name])
