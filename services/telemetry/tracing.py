"""The process's tracer, its spans, and the W3C trace context in and out of a process.

Off by default: until :func:`configure` is given an endpoint (the entry point of a
service does it, :func:`traced`), :func:`span` and :func:`server_span` return one shared
do-nothing context manager and the propagation helpers return ``None`` or ``""``: a
call costs a module-global read and a function call, no allocation (measured in
bench/tracing_overhead.py, docs/tracing.md).

On, spans are recorded by :mod:`services.telemetry.spans` (the OpenTelemetry SDK's
sampler, ids, limits and batch span processor, without the SDK's ``Tracer``, which cost
more than the rest of a span together) and sent in batches, from the SDK's thread, to an
OTLP/gRPC collector, encoded by :mod:`services.telemetry.otlp`. Sampling is
parent-based: a request that brings a ``traceparent`` keeps its caller's decision, a
trace that starts here is recorded at ``ratio``. A process that is not sampled still
propagates the context (W3C: the downstream hop sees the same trace id, unsampled).

Why our own hooks and not ``opentelemetry-instrumentation-grpc``: a search reaches a
shard as one tagged message on a long-lived ``SearchStream`` (services/index/client/
replicas.py), where per-call metadata would name the stream's first search, not this
one; the router's coalescer sends many searches as one wave; and our servers already
wrap every call once (services/rpc/server.py ``_outcome``). So the context travels in
the stream message itself, the wave's span links its members, and the server span is
opened where the call is already wrapped: no second interceptor per call.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.telemetry.config import TracingConfig

if TYPE_CHECKING:
    from services.telemetry.spans import Recorder

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_PROPAGATOR = TraceContextTextMapPropagator()

# Set by configure(), cleared by shutdown(): None = tracing off.
_recorder: Recorder | None = None

SERVER = SpanKind.SERVER
CLIENT = SpanKind.CLIENT
INTERNAL = SpanKind.INTERNAL


class _NoSpan:
    """What a ``with span(...) as s`` gets while tracing is off: takes attributes and
    drops them."""

    __slots__ = ()

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def set_error(self, description: str) -> None:
        pass

    def set_ok(self) -> None:
        pass

    def __bool__(self) -> bool:
        return False


class _NoOp:
    """The shared do-nothing context manager of a disabled tracer."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return NO_SPAN

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


NO_SPAN = _NoSpan()
NOOP = _NoOp()


class _Active:
    """A started span, current for the ``with`` block and what ``as s`` gets (attributes,
    an error status); an exception that leaves the block is recorded and sets the status
    to ERROR. Callers never import OpenTelemetry."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: trace.Span) -> None:
        self._span = span
        self._token: object = None

    def set_attribute(self, key: str, value: Any) -> None:
        self._span.set_attribute(key, value)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self._span.set_attributes(attributes)

    def set_error(self, description: str) -> None:
        self._span.set_status(Status(StatusCode.ERROR, description))

    def set_ok(self) -> None:
        """Not failed, whatever leaves the block (a gRPC abort with a caller's code)."""
        self._span.set_status(_OK)

    def __bool__(self) -> bool:
        return self._span.is_recording()

    def __enter__(self) -> _Active:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            span = self._span
            if exc is not None and span.is_recording() and _unset(span):
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        finally:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            self._span.end()


_OK = Status(StatusCode.OK)


class _Within:
    """Another task's span (a request's, kept by :func:`capture`) made current for a
    ``with`` block, without a span of its own; ``as s`` gets the no-op."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: trace.Span) -> None:
        self._span = span
        self._token: object = None

    def __enter__(self) -> _NoSpan:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return NO_SPAN

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        otel_context.detach(self._token)  # type: ignore[arg-type]


def _unset(span: trace.Span) -> bool:
    """No status was set on ``span`` by the code (one that was stays)."""
    status = getattr(span, "status", None)
    return status is None or status.status_code is StatusCode.UNSET


# --- set-up ------------------------------------------------------------------------------


def enabled() -> bool:
    return _recorder is not None


def configure(
    config: TracingConfig,
    service: str,
    attributes: Mapping[str, str] | None = None,
    exporter: Any = None,
) -> bool:
    """Start tracing for this process (``service``: its ``service.name``; ``attributes``:
    more resource attributes, e.g. the shard) when ``config`` names an endpoint; True if
    it did. ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` still apply (the SDK
    reads them). ``exporter``: an SDK span exporter to use instead of OTLP, each span
    exported as it ends (the unit tests' in-memory one)."""
    global _recorder
    if not config.enabled and exporter is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    from services.telemetry.otlp import SpanExporter
    from services.telemetry.spans import Recorder

    resource = Resource.create({"service.name": service, **(attributes or {})})
    endpoint = config.endpoint or ""
    processor: SpanProcessor
    if exporter is not None:
        processor = SimpleSpanProcessor(exporter)
    else:
        otlp = SpanExporter(
            endpoint=endpoint, insecure=not endpoint.startswith("https://"), timeout=5
        )
        processor = BatchSpanProcessor(otlp)
    _recorder = Recorder(resource, TraceIdRatioBased(config.ratio), processor, "gtr-retrieval")
    log.info("tracing on: %s, spans to %s, sample ratio %g", service, endpoint, config.ratio)
    return True


def shutdown() -> None:
    """Send the spans still buffered and stop tracing (the process is stopping)."""
    global _recorder
    recorder, _recorder = _recorder, None
    if recorder is not None:
        recorder.shutdown()


@contextlib.contextmanager
def traced(
    config: TracingConfig, service: str, attributes: Mapping[str, str] | None = None
) -> Iterator[bool]:
    """Tracing for the life of a process's ``with`` block (:func:`configure`, then
    :func:`shutdown`, which flushes)."""
    on = configure(config, service, attributes)
    try:
        yield on
    finally:
        if on:
            shutdown()


# --- spans -------------------------------------------------------------------------------


def span(name: str, kind: SpanKind = INTERNAL) -> contextlib.AbstractContextManager[Any]:
    """A child of the current span for the ``with`` block (``as s``: ``s.set_attribute``);
    the shared no-op while tracing is off."""
    recorder = _recorder
    if recorder is None:
        return NOOP
    return _Active(recorder.start(name, kind))


def annotate(attributes: Mapping[str, Any]) -> None:
    """Set ``attributes`` on the current span when it is recorded (a request's server
    span, from code that opens no span of its own); nothing while tracing is off."""
    if _recorder is None:
        return
    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes(attributes)


@dataclass(frozen=True)
class Incoming:
    """The W3C trace context a request brought (its ``traceparent`` and ``tracestate``)."""

    traceparent: str
    tracestate: str = ""


def from_pairs(pairs: Iterable[tuple[str, str]] | None) -> Incoming | None:
    """The trace context in gRPC metadata (key/value pairs, keys lower-case); None when
    tracing is off or there is none."""
    if _recorder is None or not pairs:
        return None
    parent = state = ""
    for key, value in pairs:
        if key == TRACEPARENT:
            parent = value
        elif key == TRACESTATE:
            state = value
    return Incoming(parent, state) if parent else None


def from_http_headers(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> Incoming | None:
    """The trace context of an HTTP request's headers (any case: ``Traceparent`` is
    ``traceparent``), for the HTTP/JSON front door to pass to :func:`server_span`; None
    when tracing is off or there is none."""
    if _recorder is None:
        return None
    items = headers.items() if isinstance(headers, Mapping) else headers
    return from_pairs([(str(k).lower(), str(v)) for k, v in items])


def server_span(
    name: str, incoming: Incoming | None, attributes: Mapping[str, Any] | None = None
) -> contextlib.AbstractContextManager[Any]:
    """A SERVER span for one request (``name``: a gRPC method's ``/pkg.Service/Method``
    is named without its first slash), the child of the caller's span when ``incoming``
    carries a valid context (else a new trace, sampled at the ratio); the no-op while
    tracing is off."""
    recorder = _recorder
    if recorder is None:
        return NOOP
    name = name.lstrip("/")
    parent = None
    if incoming is not None:
        carrier = {TRACEPARENT: incoming.traceparent}
        if incoming.tracestate:
            carrier[TRACESTATE] = incoming.tracestate
        parent = _PROPAGATOR.extract(carrier)
    return _Active(recorder.start(name, SERVER, parent, attributes))


# --- the context of the current span, going out -------------------------------------------


def traceparent() -> tuple[str, str]:
    """``(traceparent, tracestate)`` of the current span ("" when tracing is off or no
    span is current): what a call made now carries (sampled or not, as W3C says)."""
    if _recorder is None:
        return "", ""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return "", ""
    parent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    return parent, ctx.trace_state.to_header() if ctx.trace_state else ""


def outgoing() -> list[tuple[str, str]] | None:
    """The current context as gRPC metadata pairs (None: nothing to send)."""
    parent, state = traceparent()
    if not parent:
        return None
    return [(TRACEPARENT, parent), (TRACESTATE, state)] if state else [(TRACEPARENT, parent)]


def outgoing_headers() -> dict[str, str] | None:
    """The current context as request headers (Triton's client takes a dict)."""
    pairs = outgoing()
    return dict(pairs) if pairs else None


def exemplar() -> dict[str, str] | None:
    """``{"trace_id": ...}`` of the current span when it is recorded (the exemplar a
    Prometheus histogram keeps beside an observation); None otherwise."""
    if _recorder is None:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    return {"trace_id": f"{ctx.trace_id:032x}"}


# --- work done for several requests at once (the router's coalesced waves) ------------------


def capture() -> trace.Span | None:
    """The current span, kept by work that will run later in another task on behalf of
    this request (None: tracing off, or no span)."""
    if _recorder is None:
        return None
    current = trace.get_current_span()
    return current if current.get_span_context().is_valid else None


def batch_span(
    name: str, members: Sequence[trace.Span | None]
) -> contextlib.AbstractContextManager[Any]:
    """A span for work done for several requests at once (``members``: what
    :func:`capture` kept for each): the child of the first recorded member's span (else
    of the first member's, unrecorded as it is), with a link to every other recorded one
    (OpenTelemetry's way for a batch), and each of those gets a link back to it while it
    is still open: the batch names all its requests, and each request's trace names the
    batch that served it. Its parent is always set here, never taken from the running
    task (which may belong to an earlier request). A batch of one request makes no span
    (it would repeat the request's): that request's span is made current for the block.
    The no-op while tracing is off."""
    recorder = _recorder
    if recorder is None:
        return NOOP
    if len(members) == 1 and members[0] is not None:
        return _Within(members[0])  # a batch of one is that request's own work: no span
    known = [m for m in members if m is not None]
    recorded = [m for m in known if m.get_span_context().trace_flags.sampled]
    if recorded:
        parent = trace.set_span_in_context(NonRecordingSpan(recorded[0].get_span_context()))
    elif known:
        parent = trace.set_span_in_context(NonRecordingSpan(known[0].get_span_context()))
    else:
        parent = otel_context.Context()  # no request's: a trace of its own
    links = [Link(m.get_span_context()) for m in recorded[1:]]
    attributes = {"gtr.batch.requests": len(members)}
    batch = recorder.start(name, INTERNAL, parent, attributes, links)
    if batch.is_recording():
        for member in recorded[1:]:
            member.add_link(batch.get_span_context())
    return _Active(batch)
