"""The HTTP/JSON port: an aiohttp server on the gRPC server's event loop that answers
each route of :mod:`services.rpc.http.rules` by calling the very servicer method the
gRPC server calls for it (no loopback call through gRPC).

Around each call, what the gRPC interceptors do for a gRPC call, with the same objects:

- admission (:class:`~services.rpc.admission.Admission`, shared with the gRPC port: one
  limit for both): when the server is full a call is refused from its headers, before
  its body is read; otherwise it is admitted by what it costs, a client (its bearer
  token, else its connection) held to its share under pressure; a refusal is 429 with
  ``Retry-After`` (whole seconds, rounded up), ``retry-after-ms`` and a
  ``google.rpc.RetryInfo`` detail; health is exempt;
- bearer tokens (:class:`~services.rpc.auth.Authenticator`, the ``Authorization``
  header, the same method → scope table), checked before the body is read;
- the deadline: a ``grpc-timeout`` header (gRPC's format: ``500m``, ``5S``), else the
  service's default, given to the servicer as ``context.time_remaining()``;
- errors mapped once (:mod:`services.rpc.status`: domain error → gRPC code → HTTP
  status) into a ``google.rpc.Status`` body, internal addresses removed from public
  messages; anything unexpected is a logged INTERNAL;
- the RPC metrics (:class:`~services.rpc.metrics.RpcMetrics`, ``transport="http"``);
- with tracing on, a SERVER span (the caller's ``traceparent`` its parent) with the RPC
  and HTTP attributes, ERROR for a 5xx only, as the gRPC port's for the same calls
  (docs/tracing.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
from aiohttp import web
from google.protobuf import duration_pb2, json_format
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2

from services.common import errors
from services.rpc.admission import Admission, client_key
from services.rpc.auth import Authenticator
from services.rpc.http.rules import Route
from services.rpc.http.transcode import JSON_TYPE, reply_json, request_message
from services.rpc.metrics import RpcMetrics
from services.rpc.server import EXEMPT_PREFIXES, SERIALIZE_OFF_LOOP_BYTES, rpc_attributes
from services.rpc.status import (
    error_from_code,
    http_headers,
    http_status,
    public_message,
    retry_after_ms,
    status_of,
)
from services.telemetry import tracing

log = logging.getLogger(__name__)

Handler = Callable[[Any, Any], Awaitable[Message]]
_TIMEOUT = re.compile(r"^(\d{1,8})([HMSmun])$")
_UNIT_S = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def parse_grpc_timeout(text: str) -> float:
    """A ``grpc-timeout`` header's seconds (gRPC's wire format: up to 8 digits and a unit,
    H M S m u n); InvalidArgument naming the header otherwise."""
    match = _TIMEOUT.match(text.strip())
    if match is None:
        raise errors.InvalidArgument(
            f"grpc-timeout header {text!r}: expected up to 8 digits and a unit (H, M, S, m, "
            "u, n), e.g. 500m or 5S"
        )
    return int(match.group(1)) * _UNIT_S[match.group(2)]


class HttpCallContext:
    """What a servicer uses of a gRPC call's context, for a call that came over HTTP:
    the time left of its deadline, its peer and headers, and ``abort`` (raises the
    code's domain error, which is then mapped like any other)."""

    def __init__(self, deadline: float | None, peer: str, headers: list[tuple[str, str]]):
        self._deadline = deadline
        self._peer = peer
        self._headers = headers

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._headers

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: Any) -> NoReturn:
        raise error_from_code(code, details or code.name.lower().replace("_", " "), "health")


@dataclass
class Transcoder:
    """Serves the routes: a route's handler is the servicer method of its RPC."""

    routes: list[tuple[Route, Handler]]
    admission: Admission
    authenticator: Authenticator | None = None
    metrics: RpcMetrics | None = None
    public: bool = False
    active: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def build(
        cls, routes: Iterable[Route], services: Mapping[str, object], **kwargs: Any
    ) -> Transcoder:
        """``services``: the servicer of each service's full name (the objects the gRPC
        server registered); a route whose servicer lacks its method fails here, at start."""
        table = []
        for route in routes:
            servicer = services.get(route.service)
            handler = getattr(servicer, route.method, None)
            if handler is None:
                raise ValueError(f"no servicer method for {route.grpc_method}")
            table.append((route, handler))
        return cls(table, **kwargs)

    def match(self, request: web.Request) -> tuple[Route, Handler, dict[tuple[str, ...], str]]:
        raw_path = request.rel_url.raw_path
        verbs = []
        for route, handler in self.routes:
            try:
                values = route.binding.template.match(raw_path)
            except UnicodeDecodeError:
                raise errors.InvalidArgument("the path is not percent-encoded UTF-8") from None
            if values is None:
                continue
            if route.binding.verb == request.method:
                return route, handler, values
            verbs.append(route.binding.verb)
        allowed = f" (it takes {', '.join(sorted(set(verbs)))})" if verbs else ""
        raise errors.NotFound(f"no route for {request.method} {request.rel_url.path}{allowed}")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        start = time.perf_counter()
        self.active += 1
        self._idle.clear()
        route: Route | None = None
        code = grpc.StatusCode.OK
        exemplar: dict[str, str] | None = None
        try:
            try:
                route, handler, values = self.match(request)
            except errors.RetrievalError as exc:  # no route (404), no RPC: no span
                return self._error(status_of(exc), exc, request=request)
            # a SERVER span, the child of the caller's W3C traceparent header (docs/tracing.md)
            incoming = tracing.from_http_headers(request.headers.items())
            with tracing.server_span(route.grpc_method, incoming, {"transport": "http"}) as span:
                response: web.Response | None = None
                try:
                    code, response = await self._outcome(route, handler, values, request, start)
                    return response
                except asyncio.CancelledError:
                    code = grpc.StatusCode.CANCELLED
                    raise
                finally:
                    exemplar = tracing.exemplar()
                    if span:
                        status = response.status if response is not None else http_status(code)
                        span.set_attributes(http_attributes(route, request, code, status))
                        # HTTP's conventions for a SERVER span: a 5xx is the server's
                        # failure, a 4xx the caller's (not an error); the gRPC port agrees
                        if status >= 500:  # code OK: a health check's NOT_SERVING (503)
                            span.set_error(code.name if code.value[0] else f"HTTP {status}")
                        else:
                            span.set_ok()
        finally:
            self.active -= 1
            if not self.active:
                self._idle.set()
            if route is not None and self.metrics is not None:
                seconds = time.perf_counter() - start
                self.metrics.observe(route.method, code.name, seconds, "http", exemplar)

    async def _outcome(
        self,
        route: Route,
        handler: Handler,
        values: dict[tuple[str, ...], str],
        request: web.Request,
        start: float,
    ) -> tuple[grpc.StatusCode, web.Response]:
        """The call's gRPC code and its response: the reply, or its error mapped once
        (:mod:`services.rpc.status`); anything unexpected is a logged INTERNAL."""
        try:
            return grpc.StatusCode.OK, await self._answer(route, handler, values, request, start)
        except errors.RetrievalError as exc:
            code = status_of(exc)
            return code, self._error(code, exc, route, request)
        except web.HTTPRequestEntityTooLarge as exc:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            too_large = errors.Overloaded(f"request body too large ({exc.text}; --max-message-mb)")
            return code, self._error(code, too_large)
        except Exception as exc:
            log.exception("unhandled error in %s (HTTP)", route.grpc_method)
            code = grpc.StatusCode.INTERNAL
            internal = errors.RetrievalError(f"internal error: {type(exc).__name__}")
            return code, self._error(code, internal)

    async def _answer(
        self,
        route: Route,
        handler: Handler,
        values: dict[tuple[str, ...], str],
        request: web.Request,
        start: float,
    ) -> web.Response:
        exempt = route.grpc_method.startswith(EXEMPT_PREFIXES)
        if not exempt and self.admission.full():
            raise self.admission.refusal()
        headers = [(k.lower(), v) for k, v in request.headers.items()]
        if self.authenticator is not None:
            self.authenticator.check(route.grpc_method, headers)
        timeout = request.headers.get("grpc-timeout")
        deadline = None if timeout is None else time.monotonic() + parse_grpc_timeout(timeout)
        body = b""
        if route.binding.body:
            body = await request.read()
            if body.strip() and request.content_type != JSON_TYPE:
                raise errors.InvalidArgument(
                    f"Content-Type must be {JSON_TYPE} (got {request.content_type!r})"
                )
        message = request_message(route, values, request.query.items(), body)
        peer = _peer(request)
        context = HttpCallContext(deadline, peer, headers)
        if exempt:
            reply = await handler(message, context)
        else:
            client = client_key(peer, headers) if self.admission.shares else None
            with self.admission.admit(message, client):
                reply = await handler(message, context)
        if reply.ByteSize() >= SERIALIZE_OFF_LOOP_BYTES:
            payload = await asyncio.to_thread(reply_json, route, reply)
        else:
            payload = reply_json(route, reply)
        status = 200
        if isinstance(reply, health_pb2.HealthCheckResponse):
            status = 200 if reply.status == health_pb2.HealthCheckResponse.SERVING else 503
        return web.Response(status=status, body=payload, content_type=JSON_TYPE)

    def _error(
        self,
        code: grpc.StatusCode,
        exc: errors.RetrievalError,
        route: Route | None = None,
        request: web.Request | None = None,
    ) -> web.Response:
        """``google.rpc.Status`` as JSON, with the HTTP status of ``code``."""
        message = public_message(exc.message) if self.public else exc.message
        if message != exc.message:
            where = route.grpc_method if route else (request.path if request else "")
            log.warning("%s %s (HTTP): %s", where, code.name, exc.message)
        status = status_pb2.Status(code=code.value[0], message=message)
        hint = retry_after_ms(exc)
        if hint is not None:
            delay = duration_pb2.Duration()
            delay.FromMilliseconds(hint)
            status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        return web.Response(
            status=http_status(code),
            body=json.dumps(json_format.MessageToDict(status), separators=(",", ":")).encode(),
            content_type=JSON_TYPE,
            headers=http_headers(exc),
        )

    async def drained(self, timeout: float) -> None:
        """Wait until no call is in flight, for at most ``timeout`` seconds."""
        if self.active:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._idle.wait()


def http_attributes(
    route: Route, request: web.Request, code: grpc.StatusCode, status: int
) -> dict[str, str | int]:
    """A call's span attributes: the RPC ones the gRPC port's span has (the gRPC code the
    call mapped to) and OpenTelemetry's HTTP server ones (method, route, status)."""
    return {
        **rpc_attributes(route.grpc_method, code),
        "http.request.method": request.method,
        "http.route": route.binding.template.text,
        "http.response.status_code": status,
    }


def _peer(request: web.Request) -> str:
    """The connection, as gRPC names a peer (``ipv4:127.0.0.1:5000``), with ``http``."""
    peername = request.transport.get_extra_info("peername") if request.transport else None
    if isinstance(peername, tuple) and len(peername) >= 2:
        return f"http:{peername[0]}:{peername[1]}"
    return f"http:{request.remote or 'unknown'}"


@dataclass
class HttpServer:
    """A started HTTP/JSON server: its port, and how to stop it."""

    runner: web.AppRunner
    transcoder: Transcoder
    port: int
    stopped: bool = False

    async def stop(self, grace: float) -> None:
        """Stop listening, give the calls in flight up to ``grace`` seconds, then close
        (once: a gateway's close after its graceful stop does nothing more)."""
        if self.stopped:
            return
        self.stopped = True
        for site in list(self.runner.sites):
            await site.stop()
        await self.transcoder.drained(grace)
        await self.runner.cleanup()


async def start_http_server(
    transcoder: Transcoder,
    host: str,
    port: int,
    *,
    max_body_bytes: int,
    ssl_context: Any = None,
) -> HttpServer:
    """Serve ``transcoder`` on ``host:port`` (0: a free port), TLS with ``ssl_context``.
    A body over ``max_body_bytes`` (the gRPC port's message limit) is refused."""
    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_route("*", "/{tail:.*}", transcoder.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise errors.Unavailable(f"cannot bind {host}:{port} (HTTP): {exc.strerror}") from None
    bound = runner.addresses[0][1] if runner.addresses else port
    return HttpServer(runner, transcoder, int(bound))
