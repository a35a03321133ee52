"""How a span is recorded while tracing is on: the SDK's sampler, ids, resource, span
processor and OTLP exporter, without the SDK's ``Tracer`` and ``Span`` on the hot path.

Measured (bench/tracing_spans.py, docs/tracing.md "Cost"): a span made by the SDK's
``Tracer`` cost 53 us of the traced thread's CPU (a ``Span`` takes a lock, builds a
``BoundedAttributes`` with a lock of its own and two ``BoundedList``, cleans every
attribute value, asks the sampler also for a child, and is copied into a
``ReadableSpan`` at its end), 15 us made here: after the export (services/telemetry/
otlp.py), the largest part of what tracing cost. :class:`RecordingSpan` keeps what our
spans need (a name, a kind, the ids, the parent, two timestamps, a dict of attributes, a
status, the exception event, links) and is itself the SDK's ``ReadableSpan``, which is
what span processors and exporters take.

Kept from the SDK as it is: the sampler of a trace that starts here
(``TraceIdRatioBased``; a span with a parent is recorded when its parent is, what the
SDK's ``ParentBased`` does with its default delegates, decided here without asking it),
the random id generator and its W3C random-trace-id flag, ``Resource.create``
(``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``), the span limits of ``SpanLimits``
(``OTEL_SPAN_*_LIMIT``, ``OTEL_ATTRIBUTE_*``: applied when a span ends, to the rare span
that exceeds them), the exception event's attributes, and the span processors
(``BatchSpanProcessor`` and its ``OTEL_BSP_*`` settings). Not kept: a processor's
``on_start`` is not called (ours, batch and simple, do nothing there), and attribute
values are not cleaned when set (the code sets str, int, float and bool only; the OTLP
encoder drops any other value with a warning, as the SDK's encoder does).
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping, Sequence
from time import time_ns
from typing import Any

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, SpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)
_UNSET = Status(StatusCode.UNSET)
_KNOWN_FLAGS = TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID


class Recorder:
    """What a process records its spans with; one per process while tracing is on."""

    __slots__ = ("_ids", "_random_ids", "limits", "processor", "resource", "root", "scope")

    def __init__(
        self,
        resource: Resource,
        root: Sampler,
        processor: SpanProcessor,
        scope: str,
        ids: IdGenerator | None = None,
    ) -> None:
        """``root``: the sampler of a trace that starts here (a span with a parent is
        recorded when its parent is: parent-based sampling)."""
        self.resource = resource
        self.root = root
        self.processor = processor
        self.scope = InstrumentationScope(scope)
        self.limits = SpanLimits()
        self._ids = ids or RandomIdGenerator()
        self._random_ids = self._ids.is_trace_id_random()

    def start(
        self,
        name: str,
        kind: SpanKind,
        parent: Context | None = None,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] = (),
    ) -> trace.Span:
        """A span starting now, the child of the span of ``parent`` (a context; None: the
        current one), recorded when its parent is (a new trace: when the root sampler
        says so); an unrecorded one still carries its context on (W3C: the next hop sees
        the trace, unsampled)."""
        parent_context: SpanContext | None = trace.get_current_span(parent).get_span_context()
        state: TraceState | None
        if parent_context is not None and parent_context.is_valid:
            trace_id = parent_context.trace_id
            flags = parent_context.trace_flags
            if flags > _KNOWN_FLAGS:  # a caller's unknown flags are not passed on
                flags = TraceFlags(flags & _KNOWN_FLAGS)
            recorded = flags.sampled
            state = parent_context.trace_state
        else:
            parent_context = None
            trace_id = self._ids.generate_trace_id()
            result = self.root.should_sample(parent, trace_id, name, kind, attributes, links)
            recorded = result.decision.is_sampled()
            flags = _SAMPLED if recorded else _UNSAMPLED
            if self._random_ids:
                flags = TraceFlags(flags | TraceFlags.RANDOM_TRACE_ID)
            state = result.trace_state
            attributes = result.attributes
        context = SpanContext(
            trace_id,
            self._ids.generate_span_id(),
            is_remote=False,
            trace_flags=flags,
            trace_state=state,
        )
        if not recorded:
            return trace.NonRecordingSpan(context)
        return RecordingSpan(self, name, kind, context, parent_context, attributes, links)

    def shutdown(self) -> None:
        self.processor.shutdown()


class RecordingSpan(trace.Span, ReadableSpan):
    """A span being recorded: OpenTelemetry's API ``Span`` (so that it can be the current
    span of a context) and, as the SDK's own span is, the SDK's ``ReadableSpan`` that the
    span processor takes at :meth:`end` (no copy is made; nothing changes it after its
    end, when the exporting thread may read it). One task uses it, as our hooks do: no
    lock."""

    def __init__(
        self,
        recorder: Recorder,
        name: str,
        kind: SpanKind,
        context: SpanContext,
        parent: SpanContext | None,
        attributes: Mapping[str, Any] | None,
        links: Sequence[Link],
    ) -> None:
        # ReadableSpan's own fields (its properties read them), set here without its
        # __init__, as the SDK's span does
        self._recorder = recorder
        self._name = name
        self._kind = kind
        self._context = context
        self._parent = parent
        self._attributes: Any = dict(attributes) if attributes else {}
        self._links: Any = links
        self._events: Any = ()
        self._status = _UNSET
        self._resource = recorder.resource
        self._instrumentation_scope = recorder.scope
        self._instrumentation_info = None
        self._end_time: int | None = None
        self._start_time = time_ns()

    def get_span_context(self) -> SpanContext:
        return self._context  # type: ignore[return-value]  # set in __init__, never None

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self._end_time is None:
            self._attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self._end_time is None:
            self._attributes.update(attributes)

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        """A link added after the start (ignored once the span has ended)."""
        if self._end_time is None:
            self._links = (*self._links, Link(context, attributes))

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        """As the SDK: an OK status stays, UNSET is no change."""
        if self._end_time is not None or self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            self._status = status

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        if self._end_time is None:
            self._events = [*self._events, Event(name, dict(attributes or {}), timestamp)]

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        """The SDK's ``exception`` event (type, message, stack trace)."""
        module, qualname = type(exception).__module__, type(exception).__qualname__
        recorded = {
            "exception.type": f"{module}.{qualname}" if module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        self.add_event("exception", {**recorded, **(attributes or {})}, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            return
        limits = self._recorder.limits
        most = limits.max_span_attributes
        if (most is not None and len(self._attributes) > most) or (
            limits.max_span_attribute_length is not None
        ):
            self._attributes = BoundedAttributes(
                most,
                self._attributes,
                immutable=True,
                max_value_len=limits.max_span_attribute_length,
            )
        if limits.max_links is not None and len(self._links) > limits.max_links:
            self._links = BoundedList.from_seq(limits.max_links, self._links)
        self._end_time = end_time if end_time is not None else time_ns()
        self._recorder.processor.on_end(self)
