"""services/telemetry: the tracer off (shared no-ops, nothing propagated) and on (spans,
W3C context in and out, parent-based sampling, the coalesced wave's links, exemplars),
with the SDK's in-memory exporter; the OTLP path is tests/integration/test_tracing.py's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from grpc import StatusCode
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.rpc.server import SERVER_ERRORS
from services.rpc.status import http_status
from services.telemetry import tracing
from services.telemetry.config import TracingConfig

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-1af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    assert tracing.configure(TracingConfig(None, 1.0), "test", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def test_the_config_reads_the_opentelemetry_variables() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    assert TracingConfig.resolve(None, None, env) == TracingConfig("http://c:4317", 0.5)
    assert TracingConfig.resolve("http://d:4317", 1.0, env) == TracingConfig("http://d:4317", 1.0)
    assert not TracingConfig.resolve(None, None, {}).enabled
    assert not TracingConfig.resolve("http://d:4317", None, {"OTEL_SDK_DISABLED": "true"}).enabled
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER_ARG"):
        TracingConfig.resolve(None, None, {"OTEL_TRACES_SAMPLER_ARG": "half"})


def test_off_every_call_is_the_shared_no_op() -> None:
    assert not tracing.enabled()
    assert not tracing.configure(TracingConfig(None), "test")
    assert tracing.span("x") is tracing.NOOP
    assert tracing.server_span("/a.B/C", tracing.Incoming(PARENT)) is tracing.NOOP
    with tracing.span("x") as span:
        assert not span
        span.set_attribute("k", 1)
    assert tracing.traceparent() == ("", "")
    assert tracing.outgoing() is None and tracing.exemplar() is None
    assert tracing.from_pairs([("traceparent", PARENT)]) is None
    assert tracing.from_http_headers({"Traceparent": PARENT}) is None


def test_a_request_is_the_child_of_its_callers_span(spans: InMemorySpanExporter) -> None:
    incoming = tracing.from_http_headers({"Traceparent": PARENT, "TraceState": "k=v"})
    assert incoming == tracing.Incoming(PARENT, "k=v")
    with tracing.server_span("/pkg.Service/Method", incoming):
        with tracing.span("stage", tracing.CLIENT):
            parent, state = tracing.traceparent()
            exemplar = tracing.exemplar()
    (server,) = [s for s in spans.get_finished_spans() if s.name == "pkg.Service/Method"]
    (stage,) = [s for s in spans.get_finished_spans() if s.name == "stage"]
    assert server.context.trace_id == int("0af7651916cd43dd8448eb211c80319c", 16)
    assert server.parent is not None and server.parent.span_id == int("b7ad6b7169203331", 16)
    assert stage.parent is not None and stage.parent.span_id == server.context.span_id
    assert parent == f"00-{server.context.trace_id:032x}-{stage.context.span_id:016x}-01"
    assert state == "k=v"
    assert exemplar == {"trace_id": "0af7651916cd43dd8448eb211c80319c"}


def test_an_unsampled_caller_is_not_recorded_but_propagated(spans: InMemorySpanExporter) -> None:
    with tracing.server_span("/a.B/C", tracing.from_pairs([("traceparent", UNSAMPLED)])):
        assert tracing.traceparent()[0].startswith("00-1af7651916cd43dd8448eb211c80319c-")
        assert tracing.traceparent()[0].endswith("-00")
        assert tracing.exemplar() is None
    assert spans.get_finished_spans() == ()


def test_an_exception_marks_the_span_failed(spans: InMemorySpanExporter) -> None:
    with pytest.raises(KeyError), tracing.span("broken"):
        raise KeyError("x")
    (span,) = spans.get_finished_spans()
    assert not span.status.is_ok and span.events[0].name == "exception"


def test_a_wave_is_the_child_of_its_first_recorded_member_and_links_the_rest(
    spans: InMemorySpanExporter,
) -> None:
    members = []
    with contextlib.ExitStack() as requests:  # three requests still open when the wave runs
        for name in ("a", "b", "c"):
            requests.enter_context(tracing.span(name))
            members.append(tracing.capture())
        with tracing.server_span("/x.Y/Z", tracing.Incoming(UNSAMPLED)):
            members.insert(0, tracing.capture())  # an unsampled member first: not the parent
        with tracing.span("an earlier request"), tracing.batch_span("wave", members):
            with tracing.span("shard search"):
                pass
    finished = {s.name: s for s in spans.get_finished_spans()}
    wave, shard = finished["wave"], finished["shard search"]
    assert wave.parent is not None and wave.parent.span_id == finished["a"].context.span_id
    assert [link.context.span_id for link in wave.links] == [
        finished["b"].context.span_id,
        finished["c"].context.span_id,
    ]
    assert shard.parent is not None and shard.parent.span_id == wave.context.span_id
    # the linked requests name the wave that served them (the parent has it as a child)
    for name in ("b", "c"):
        assert [link.context.span_id for link in finished[name].links] == [wave.context.span_id]
    assert finished["a"].links == ()


def test_a_wave_of_one_request_has_no_span_of_its_own(spans: InMemorySpanExporter) -> None:
    with tracing.server_span("/a.B/C", None):
        member = tracing.capture()
    with tracing.span("an earlier request"), tracing.batch_span("wave", [member]):
        with tracing.span("shard search"):
            pass
    finished = {s.name: s for s in spans.get_finished_spans()}
    assert "wave" not in finished
    shard = finished["shard search"]
    assert shard.parent is not None and shard.parent.span_id == finished["a.B/C"].context.span_id


def test_a_trace_that_starts_here_is_recorded_at_the_ratio() -> None:
    exporter = InMemorySpanExporter()
    assert tracing.configure(TracingConfig(None, 0.0), "test", exporter=exporter)
    try:
        with tracing.server_span("/a.B/C", None) as root, tracing.span("child") as child:
            assert not root and not child
            parent, _ = tracing.traceparent()
            assert parent.endswith("-02")  # unsampled, carried on (random trace id: W3C 2)
        with tracing.server_span("/a.B/C", tracing.Incoming(PARENT)) as traced:
            assert traced  # the caller's sampled flag wins over the ratio
    finally:
        tracing.shutdown()
    assert [s.name for s in exporter.get_finished_spans()] == ["a.B/C"]


def test_the_sdks_span_limits_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "2")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "3")
    monkeypatch.setenv("OTEL_SPAN_LINK_COUNT_LIMIT", "1")
    exporter = InMemorySpanExporter()
    assert tracing.configure(TracingConfig(None, 1.0), "test", exporter=exporter)
    try:
        with tracing.span("a") as a:
            first = tracing.capture()
            a.set_attributes({"x": "long value", "y": 2, "z": 3})
        with tracing.span("b"):
            second = tracing.capture()
        with tracing.batch_span("wave", [first, second, first]):
            pass
    finally:
        tracing.shutdown()
    finished = {s.name: s for s in exporter.get_finished_spans()}
    attributes = dict(finished["a"].attributes or {})
    assert finished["a"].dropped_attributes == 1 and len(attributes) == 2
    assert all(len(str(v)) <= 3 for v in attributes.values())
    assert len(finished["wave"].links) == 1 and finished["wave"].dropped_links == 1


def test_a_status_set_ok_stays_ok(spans: InMemorySpanExporter) -> None:
    with pytest.raises(RuntimeError), tracing.span("answered") as span:
        span.set_ok()  # a gRPC abort with the caller's code: not the server's failure
        span.set_error("later")
        raise RuntimeError("abort")
    (answered,) = spans.get_finished_spans()
    assert answered.status.is_ok and answered.events == ()


def test_the_http_and_grpc_ports_mark_the_same_calls_failed() -> None:
    # the gRPC port marks a SERVER span ERROR for the codes of OpenTelemetry's RPC
    # conventions; the HTTP port for a 5xx (its HTTP conventions): the same codes
    assert {c for c in StatusCode if http_status(c) >= 500} == SERVER_ERRORS
    assert (
        http_status(StatusCode.INVALID_ARGUMENT) == 400
        and StatusCode.NOT_FOUND not in SERVER_ERRORS
    )
