"""The OTLP/gRPC span exporter, with a cheaper encoding of the spans into OTLP's protobuf.

The SDK's exporter (``opentelemetry-exporter-otlp-proto-grpc``) turns every span into
protobuf messages built from keyword arguments, one nested message per attribute, value
and status, and groups the spans by resource with ``Resource.__hash__``, which dumps the
resource's attributes to JSON for every span. That runs in the exporting thread of the
traced process itself: 38 us of CPU per span, 42 % of what a span cost in all
(bench/tracing_spans.py; docs/tracing.md "Cost").

:func:`encode` writes the same ``ExportTraceServiceRequest`` (equal message, equal
bytes: tests/unit/test_tracing_otlp.py compares it with the SDK's ``encode_spans``)
by setting the fields of one span message added in place, the resource and scope encoded
once per batch: 17 us per span of the SDK's spans, 11 us of services/telemetry/spans.py's
(the same bench). Everything else (the gRPC channel, TLS,
retries, timeouts, headers, compression, the ``OTEL_EXPORTER_OTLP_*`` variables) is the
SDK's exporter as it is: :class:`SpanExporter` only replaces its ``_translate_data``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.common._internal import (
    _encode_instrumentation_scope,
    _encode_resource,
    _encode_value,
)
from opentelemetry.exporter.otlp.proto.common._internal.trace_encoder import (
    _encode_events,
    _encode_links,
)
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, SpanFlags
from opentelemetry.sdk.trace import ReadableSpan

log = logging.getLogger(__name__)

_HAS_IS_REMOTE = SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_IS_REMOTE = _HAS_IS_REMOTE | SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK


def encode(spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
    """The OTLP request for ``spans``: what the SDK's ``encode_spans`` makes (the spans
    grouped by resource, then by instrumentation scope, in the order first seen)."""
    request = ExportTraceServiceRequest()
    # grouped by the objects themselves: a process's spans share one resource and one
    # scope object (equal but distinct objects make a group each, still valid OTLP)
    by_resource: dict[int, tuple[Any, dict[int, ScopeSpans]]] = {}
    for span in spans:
        resource = span.resource
        scope = span.instrumentation_scope
        group = by_resource.get(id(resource))
        if group is None:
            resource_spans = request.resource_spans.add()
            resource_spans.resource.CopyFrom(_encode_resource(resource))
            resource_spans.schema_url = resource.schema_url
            group = by_resource[id(resource)] = (resource_spans, {})
        scopes = group[1]
        scope_spans = scopes.get(id(scope))
        if scope_spans is None:
            scope_spans = scopes[id(scope)] = group[0].scope_spans.add()
            scope_spans.scope.CopyFrom(_encode_instrumentation_scope(scope))  # type: ignore[arg-type]
            if scope is not None and scope.schema_url:
                scope_spans.schema_url = scope.schema_url
        _encode_span(span, scope_spans.spans.add())
    return request


def _encode_span(span: ReadableSpan, out: Any) -> None:
    """``span`` into ``out``, an OTLP ``Span`` message added to its scope's list."""
    context = span.context
    assert context is not None  # a finished SDK span has one
    out.trace_id = context.trace_id.to_bytes(16, "big")
    out.span_id = context.span_id.to_bytes(8, "big")
    if context.trace_state:
        out.trace_state = ",".join(f"{k}={v}" for k, v in context.trace_state.items())
    parent = span.parent
    if parent is not None:
        out.parent_span_id = parent.span_id.to_bytes(8, "big")
        out.flags = _IS_REMOTE if parent.is_remote else _HAS_IS_REMOTE
    else:
        out.flags = _HAS_IS_REMOTE
    out.name = span.name
    out.kind = span.kind.value + 1  # OTLP counts from SPAN_KIND_UNSPECIFIED = 0
    out.start_time_unix_nano = span.start_time or 0
    out.end_time_unix_nano = span.end_time or 0
    attributes = span.attributes
    if attributes:
        add = out.attributes.add
        for key, value in attributes.items():
            kind = type(value)
            if kind is str:
                add(key=key).value.string_value = value
            elif kind is int:
                add(key=key).value.int_value = value
            elif kind is float:
                add(key=key).value.double_value = value
            elif kind is bool:
                add(key=key).value.bool_value = value
            else:  # sequences, bytes: the SDK's own conversion
                try:
                    encoded = _encode_value(value)
                except Exception:  # as the SDK's encoder: that attribute is dropped
                    log.warning("span %r: attribute %s dropped (%r)", span.name, key, value)
                    continue
                add(key=key, value=encoded)
    if span.events:
        out.events.extend(_encode_events(span.events))  # type: ignore[arg-type]
    if span.links:
        out.links.extend(_encode_links(span.links))
    status = span.status
    out.status.SetInParent()  # present even when UNSET, as the SDK's encoding has it
    if status.status_code.value:
        out.status.code = status.status_code.value
    if status.description:
        out.status.message = status.description
    if span.dropped_attributes:
        out.dropped_attributes_count = span.dropped_attributes
    if span.dropped_events:
        out.dropped_events_count = span.dropped_events
    if span.dropped_links:
        out.dropped_links_count = span.dropped_links


class SpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/gRPC span exporter with :func:`encode` as its encoding."""

    def _translate_data(self, data: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
        return encode(data)
