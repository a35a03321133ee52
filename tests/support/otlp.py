"""A real OpenTelemetry collector's receiving end, for the tracing tests and bench: the
OTLP/gRPC ``TraceService/Export`` of OpenTelemetry's own service definitions
(``opentelemetry-proto``), where our processes send their spans, and OTLP/HTTP
``POST /v1/traces`` (JSON or protobuf bodies), where Triton's build sends its own.
Both listen on free loopback ports in threads of the test process and keep every span
they receive as a :class:`Received`."""

from __future__ import annotations

import base64
import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class Received:
    """One span as the receiver got it (ids as lower-case hex, "" for no parent)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    attributes: dict[str, Any]
    instance: str = ""  # the resource's service.instance.id (a shard replica)
    links: tuple[str, ...] = ()  # the span ids it links to
    status: int = 0  # OTLP's status code: 0 UNSET, 1 OK, 2 ERROR


def _value(v: Any) -> Any:
    for key in ("string_value", "int_value", "bool_value", "double_value"):
        if v.HasField(key):
            return getattr(v, key)
    return None


def _json_value(v: dict[str, Any]) -> Any:
    for key in ("stringValue", "intValue", "boolValue", "doubleValue"):
        if key in v:
            return int(v[key]) if key == "intValue" else v[key]
    return None


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> list[Received]:
    out = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    Received(
                        service=str(resource.get("service.name", "")),
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent=s.parent_span_id.hex(),
                        kind=s.kind,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        instance=str(resource.get("service.instance.id", "")),
                        links=tuple(link.span_id.hex() for link in s.links),
                        status=s.status.code,
                    )
                )
    return out


def _hex(value: str) -> str:
    """An id of OTLP/JSON: hex as the specification says (Triton), or protobuf's base64."""
    if len(value) in (16, 32) and all(c in "0123456789abcdefABCDEF" for c in value):
        return value.lower()
    return base64.b64decode(value).hex() if value else ""


def spans_of_json(body: dict[str, Any]) -> list[Received]:
    out = []
    for rs in body.get("resourceSpans", []):
        resource = {
            a["key"]: _json_value(a["value"]) for a in rs.get("resource", {}).get("attributes", [])
        }
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                out.append(
                    Received(
                        service=str(resource.get("service.name", "")),
                        name=s["name"],
                        trace_id=_hex(s["traceId"]),
                        span_id=_hex(s["spanId"]),
                        parent=_hex(s.get("parentSpanId", "")),
                        kind=int(s.get("kind", 0)),
                        attributes={
                            a["key"]: _json_value(a["value"]) for a in s.get("attributes", [])
                        },
                        instance=str(resource.get("service.instance.id", "")),
                        status=_status_code(s.get("status", {}).get("code", 0)),
                    )
                )
    return out


def _status_code(code: int | str) -> int:
    """OTLP/JSON's status code: a number, or the enum's name (protobuf's JSON)."""
    names = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}
    return names[code] if isinstance(code, str) else int(code)


@dataclass
class Receiver:
    """The spans received so far, and where to send them."""

    grpc_port: int = 0
    http_port: int = 0
    spans: list[Received] = field(default_factory=list)
    exports: int = 0  # Export calls and POSTs received
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1/traces"

    def add(self, spans: list[Received]) -> None:
        with self._lock:
            self.spans.extend(spans)
            self.exports += 1

    def trace(self, trace_id: str) -> list[Received]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def matching(self, keep: Callable[[Received], bool]) -> list[Received]:
        with self._lock:
            return [s for s in self.spans if keep(s)]

    def wait(self, condition: Callable[[Receiver], bool], what: str, timeout: float = 30.0) -> None:
        """Until ``condition(self)`` holds (AssertionError naming ``what`` and listing what
        arrived after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while not condition(self):
            if time.monotonic() > deadline:
                got = sorted({(s.service, s.name) for s in self.spans})
                raise AssertionError(f"not within {timeout:.0f} s: {what}; received {got}")
            time.sleep(0.05)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self._receiver.add(spans_of(request))
        return trace_service_pb2.ExportTraceServiceResponse()


def _http_handler(receiver: Receiver) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if "json" in (self.headers.get("content-type") or ""):
                receiver.add(spans_of_json(json.loads(body)))
            else:
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(spans_of(request))
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """An OTLP/gRPC and an OTLP/HTTP receiver on free loopback ports, stopped on exit."""
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(receiver), server)
    receiver.grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _http_handler(receiver))
    receiver.http_port = int(web.server_address[1])
    thread = threading.Thread(target=web.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        web.shutdown()
        web.server_close()
        server.stop(0)
