"""services/telemetry/otlp.py: the cheaper OTLP encoding writes what the SDK's own
``encode_spans`` writes (equal messages, equal bytes) for every kind of span our recorder
and the SDK make, and the exporter uses it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.telemetry import tracing
from services.telemetry.config import TracingConfig
from services.telemetry.otlp import SpanExporter, encode

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def ours() -> Iterator[InMemorySpanExporter]:
    """Spans made by our hooks (services/telemetry/spans.py's recorder)."""
    exporter = InMemorySpanExporter()
    assert tracing.configure(TracingConfig(None, 1.0), "gtr-test", {"gtr.shard": "1"}, exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def _our_spans(exporter: InMemorySpanExporter) -> Sequence[ReadableSpan]:
    incoming = tracing.Incoming(PARENT, "vendor=a,other=b")
    with tracing.server_span("/pkg.Service/Method", incoming, {"transport": "http"}) as root:
        root.set_attributes({"rpc.grpc.status_code": 0, "ratio": 0.5, "cached": True})
        with tracing.span("stage", tracing.CLIENT) as stage:
            stage.set_attribute("ids", ("a", "b"))
            stage.set_attribute("blob", b"\x00\x01")
            stage.set_error("UNAVAILABLE")
        members = [tracing.capture()]
        with tracing.span("another"):
            members.append(tracing.capture())
        with tracing.batch_span("wave", members):
            pass
        with pytest.raises(KeyError), tracing.span("broken"):
            raise KeyError("x")
        root.set_ok()
    return exporter.get_finished_spans()


def _sdk_spans() -> Sequence[ReadableSpan]:
    """Spans of two resources and two scopes, as the SDK's own tracer makes them."""
    memory = InMemorySpanExporter()
    spans: list[ReadableSpan] = []
    for service in ("one", "two"):
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        for scope in ("a", "b"):
            tracer = provider.get_tracer(scope, "1.0", schema_url="https://x/1.0")
            with tracer.start_as_current_span("s", kind=SpanKind.PRODUCER) as outer:
                outer.add_event("event", {"n": 1})
                outer.add_link(outer.get_span_context(), {"why": "self"})
                outer.set_status(Status(StatusCode.ERROR, "broken"))
                with tracer.start_as_current_span("t", attributes={"list": [1, 2]}):
                    pass
    spans.extend(memory.get_finished_spans())
    return spans


def test_our_spans_encode_as_the_sdk_encodes_them(ours: InMemorySpanExporter) -> None:
    spans = _our_spans(ours)
    assert {s.name for s in spans} == {"pkg.Service/Method", "stage", "another", "wave", "broken"}
    mine, sdk = encode(spans), encode_spans(spans)
    assert mine == sdk
    assert mine.SerializeToString(deterministic=True) == sdk.SerializeToString(deterministic=True)
    (server,) = [s for s in mine.resource_spans[0].scope_spans[0].spans if s.name.startswith("pkg")]
    assert server.flags == 0x300  # the parent is remote (the caller's)
    assert server.trace_state == "vendor=a,other=b"


def test_the_sdks_spans_encode_as_the_sdk_encodes_them() -> None:
    spans = _sdk_spans()
    mine, sdk = encode(spans), encode_spans(spans)
    assert len(mine.resource_spans) == 2
    assert [len(r.scope_spans) for r in mine.resource_spans] == [2, 2]
    assert mine == sdk
    assert mine.SerializeToString(deterministic=True) == sdk.SerializeToString(deterministic=True)


def test_a_value_otlp_cannot_carry_is_dropped_as_the_sdk_drops_it(
    ours: InMemorySpanExporter,
) -> None:
    with tracing.span("odd") as span:
        span.set_attributes({"kept": 1, "odd": object(), "also kept": "yes"})
    spans = ours.get_finished_spans()
    mine = encode(spans)
    assert mine == encode_spans(spans)
    encoded = mine.resource_spans[0].scope_spans[0].spans[0]
    assert [a.key for a in encoded.attributes] == ["kept", "also kept"]


def test_the_exporter_sends_this_encoding() -> None:
    # the SDK exporter's hook that SpanExporter overrides still exists (an SDK upgrade
    # that renames it fails here, not silently in production)
    assert "_translate_data" in vars(OTLPSpanExporter)
    exporter = SpanExporter(endpoint="http://127.0.0.1:1", insecure=True)
    try:
        spans = _sdk_spans()
        assert exporter._translate_data(spans) == encode_spans(spans)
    finally:
        exporter.shutdown()
