"""Process bootstrap for every gRPC service: ``create_server(...) -> (server, port)``.

Every server gets: the gRPC health service, reflection, the interceptor that maps domain
errors to status codes and records latency, request bytes that fail to parse answered
with INVALID_ARGUMENT (not INTERNAL), a graceful stop on SIGTERM/SIGINT, admission
control (``max_in_flight``: unary calls over the limit are refused RESOURCE_EXHAUSTED
with a ``retry-after-ms`` hint in the trailing metadata, and the same value as gRPC's own
``grpc-retry-pushback-ms`` so that a client's retry policy waits it, before any work;
a full store's refusal says "no retry" (``services.rpc.status.trailing_metadata``);
health and reflection are exempt; a client's share of the limit under load,
:mod:`services.rpc.admission`), a bound on the streams one connection may have open
(``max_streams_per_connection``: one client's tiny-deadline flood cannot fill gRPC's
backlog of calls for everyone, docs/architecture.md "One client's flood") and, when the
service gives it a check, a health watcher that
keeps the health status true to that check (:meth:`Server.watch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from services.common import errors, timeouts
from services.rpc.admission import Admission, client_key
from services.rpc.interceptors import HandlerInterceptor
from services.rpc.metrics import RpcMetrics, serve_metrics
from services.rpc.settings import ServiceSettings
from services.rpc.status import public_message, status_of, trailing_metadata
from services.rpc.wire import WireTypeError, check_wire_types
from services.telemetry import tracing

log = logging.getLogger(__name__)

# Never refused by admission control: probes must answer when the server is full.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class _Malformed:
    """Stands in for a request whose bytes did not parse, so the handler can reject it."""

    reason: str


def _safe_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if deserialize is None:
            return data
        try:
            message = deserialize(data)
            check_wire_types(message)
            return message
        except (DecodeError, WireTypeError, ValueError) as exc:
            return _Malformed(str(exc) or type(exc).__name__)

    return parse


class ErrorAndLatencyInterceptor(HandlerInterceptor):
    """Maps :mod:`services.common.errors` to status codes, records RPC latency, and admits
    unary calls under the in-flight limit (streams are not counted: a long-lived stream
    is a channel, not a request)."""

    def __init__(
        self, metrics: RpcMetrics | None, admission: Admission | None = None, public: bool = False
    ) -> None:
        self._metrics = metrics
        self._admission = admission or Admission()
        # the public gateway: an error's text loses its internal addresses (logged whole)
        self._public = public

    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if handler.stream_stream is not None:
            return self._stream(handler, details)
        if handler.unary_stream is not None and not details.method.startswith(EXEMPT_PREFIXES):
            return self._response_stream(handler, details)
        if handler.unary_unary is None:
            return handler
        if self._admission.full() and not details.method.startswith(EXEMPT_PREFIXES):
            return self._refused(details)
        behavior = handler.unary_unary
        serialize = handler.response_serializer
        admit: Callable[[Any, str | None], contextlib.AbstractContextManager[None]] = (
            (lambda _request, _client: contextlib.nullcontext())
            if details.method.startswith(EXEMPT_PREFIXES)
            else self._admission.admit
        )

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with self._outcome(details, context):
                client = (
                    client_key(context.peer(), details.invocation_metadata)
                    if self._admission.shares
                    else None
                )
                with admit(None if isinstance(request, _Malformed) else request, client):
                    if isinstance(request, _Malformed):
                        raise errors.InvalidArgument(f"malformed request: {request.reason}")
                    reply = await behavior(request, context)
                    return await _serialized(serialize, reply)

        return grpc.unary_unary_rpc_method_handler(
            wrapped,
            request_deserializer=_safe_deserializer(handler.request_deserializer),
            response_serializer=None,  # `_serialized` made the bytes
        )

    def _refused(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """A unary call that arrives while the server is full: refused with the hint
        before its request is read or parsed. Served as a client stream that is never
        read (gRPC reads a unary request before calling the handler; this one answers
        at once), which the client cannot tell from a unary call."""

        async def refuse(
            _requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> None:
            async with self._outcome(details, context):
                raise self._admission.refusal()

        return grpc.stream_unary_rpc_method_handler(refuse)

    def _stream(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        """Bidirectional streams: a malformed message ends the stream with INVALID_ARGUMENT,
        a domain error raised at stream level gets its code. (Per-message errors are the
        servicer's: it answers them in the stream.) Latency is recorded per stream."""
        behavior = handler.stream_stream

        async def checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, _Malformed):
                    # raised, not aborted here: the handler may read in another task, and
                    # the abort must happen in the handler's own (`_outcome`)
                    raise errors.InvalidArgument(f"malformed message: {request.reason}")
                yield request

        async def wrapped(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            async with self._outcome(details, context, traced=False):
                async for reply in behavior(checked(requests), context):
                    yield reply

        return grpc.stream_stream_rpc_method_handler(
            wrapped,
            request_deserializer=_safe_deserializer(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )

    def _response_stream(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        """Server streams (a peer's snapshot): a malformed request is INVALID_ARGUMENT, a
        domain error raised before or between the messages gets its code. Not admitted
        under the in-flight limit (a long transfer is not a request in the queue)."""
        behavior = handler.unary_stream

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with self._outcome(details, context):
                if isinstance(request, _Malformed):
                    raise errors.InvalidArgument(f"malformed request: {request.reason}")
                async for reply in behavior(request, context):
                    yield reply

        return grpc.unary_stream_rpc_method_handler(
            wrapped,
            request_deserializer=_safe_deserializer(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )

    @contextlib.asynccontextmanager
    async def _outcome(
        self,
        details: grpc.HandlerCallDetails,
        context: grpc.aio.ServicerContext,
        traced: bool = True,
    ) -> AsyncIterator[None]:
        """Around one call (unary or stream): domain errors abort with their status code,
        a cancellation that is not the call's own with UNAVAILABLE, anything else with
        INTERNAL; the call's code and latency go to the metrics. With
        tracing on (``traced``: not a long-lived stream, whose messages have spans of
        their own), the call is a SERVER span, the child of the caller's ``traceparent``,
        and its latency observation keeps the trace id as an exemplar."""
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        scope = (
            tracing.server_span(details.method, tracing.from_pairs(details.invocation_metadata))
            if traced
            else _UNTRACED
        )
        with scope as span:
            try:
                yield
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            except errors.RetrievalError as exc:
                code = status_of(exc)
                message = public_message(exc.message) if self._public else exc.message
                if message != exc.message:
                    log.warning("%s %s: %s", details.method, code.name, exc.message)
                await context.abort(code, message, trailing_metadata=trailing_metadata(exc))
            except asyncio.CancelledError:
                if _cancelled_by_caller(context):
                    code = grpc.StatusCode.CANCELLED
                    raise
                # a call inside ended cancelled (its channel closed under it), not this
                # one: answered, or the caller would wait for its own deadline
                code = grpc.StatusCode.UNAVAILABLE
                log.warning("%s: an inner call was cancelled", details.method, exc_info=True)
                await context.abort(
                    code, "interrupted inside the server (an inner call was cancelled); try again"
                )
            except Exception as exc:
                code = grpc.StatusCode.INTERNAL
                log.exception("unhandled error in %s", details.method)
                await context.abort(code, f"internal error: {type(exc).__name__}")
            finally:
                if span:
                    span.set_attributes(rpc_attributes(details.method, code))
                    if code in SERVER_ERRORS:
                        span.set_error(code.name)
                    else:
                        span.set_ok()
                if self._metrics is not None:
                    method = details.method.rsplit("/", 1)[-1]
                    self._metrics.observe(
                        method, code.name, time.perf_counter() - start, exemplar=tracing.exemplar()
                    )


def _cancelled_by_caller(context: grpc.aio.ServicerContext) -> bool:
    """Whether a CancelledError in a handler is the call's own cancellation (the caller
    cancelled, its deadline passed, the server stops: gRPC cancels the handler's task)
    rather than one raised by an inner call cancelled under it."""
    task = asyncio.current_task()
    if task is None or task.cancelling():
        return True
    try:
        return bool(context.cancelled())
    except Exception:  # a context without the call's state: take it as the call's own
        return True


# The codes that mark a server span as failed (OpenTelemetry's RPC conventions): the
# server's fault, not the caller's (INVALID_ARGUMENT, NOT_FOUND, ... are answers).
SERVER_ERRORS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def rpc_attributes(method: str, code: grpc.StatusCode) -> dict[str, str | int]:
    """OpenTelemetry's RPC attributes of a call to ``method`` (``/pkg.Service/Method``)."""
    service, _, name = method.lstrip("/").partition("/")
    return {
        "rpc.system": "grpc",
        "rpc.service": service,
        "rpc.method": name,
        "rpc.grpc.status_code": code.value[0],
    }


_UNTRACED = contextlib.nullcontext(tracing.NO_SPAN)

# An answer at least this large is serialised off the event loop (a k=1000 search with
# its documents is ~1.5 MB); below it the thread hop costs more than it frees.
SERIALIZE_OFF_LOOP_BYTES = 256 * 1024


async def _serialized(serialize: Callable[[Any], bytes] | None, reply: Any) -> Any:
    """``reply`` as bytes; a large one serialised in a worker thread, so that the event
    loop goes on accepting (and refusing) calls meanwhile."""
    if serialize is None:
        return reply
    if hasattr(reply, "ByteSize") and reply.ByteSize() >= SERIALIZE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(serialize, reply)
    return serialize(reply)


HealthCheck = Callable[[], Awaitable[bool]]


@dataclass
class Server:
    """A started gRPC server, its bound port, its health servicer and its admission."""

    grpc_server: grpc.aio.Server
    port: int
    health: HealthServicer
    services: list[str] = field(default_factory=list)
    admission: Admission = field(default_factory=Admission)
    # plaintext, health service only (``health_port``): for probes that cannot speak TLS
    health_server: grpc.aio.Server | None = None
    # servers beside this one that stop with it, with the same grace (the gateway's
    # HTTP/JSON port): each is called with the grace seconds
    also_stop: list[Callable[[float], Awaitable[None]]] = field(default_factory=list)
    # called as the server begins to stop, before its drain: each ends what would hold the
    # drain open to its grace (a shard's long-lived search streams, which the router
    # keeps open for as long as the replica runs)
    drains: list[Callable[[], None]] = field(default_factory=list)
    _watcher: asyncio.Task[None] | None = field(default=None, repr=False)

    def watch(self, check: HealthCheck, interval_s: float, what: str) -> None:
        """Keep the health status true to ``check``: a background task asks it every
        ``interval_s`` (no request waits for it) and sets NOT_SERVING when it says False
        or fails, SERVING when it says True again. Changes are logged; :meth:`stop` ends
        the watcher first, so nothing turns a stopping server SERVING again."""

        async def run() -> None:
            serving = True
            while True:
                await asyncio.sleep(interval_s)
                try:
                    async with asyncio.timeout(interval_s):
                        ok = await check()
                except Exception as exc:  # a failing check is a failed one
                    log.debug("health check of %s failed: %r", what, exc)
                    ok = False
                if ok != serving:
                    serving = ok
                    log.warning("%s: %s", what, "SERVING again" if ok else "NOT_SERVING")
                    await self.set_serving(ok)

        if self._watcher is None:
            self._watcher = asyncio.ensure_future(run())

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.services]:
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        # its cancel sent again until it ends: one lost inside redis-py (a Redis health
        # check answering as the cancel came) left the loop running and this stop waiting
        await timeouts.cancel_and_wait(self._watcher)
        await self.set_serving(False)
        for drain in self.drains:
            drain()
        await asyncio.gather(self.grpc_server.stop(grace), *(f(grace) for f in self.also_stop))
        if self.health_server is not None:
            await self.health_server.stop(0)


Registrar = Callable[[grpc.aio.Server], Iterable[str]]


async def create_server(
    settings: ServiceSettings,
    register: Registrar,
    metrics: RpcMetrics | None = None,
    admission: Admission | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    public: bool = False,
) -> tuple[Server, int]:
    """Build, bind and start a server; ``register`` adds servicers and returns their names.

    ``settings.port = 0`` binds a free port; the bound port is returned. ``admission``:
    the in-flight limit, when the service reads its pressure (the gateway); by default
    one from ``settings.max_in_flight``. ``interceptors`` run inside the error mapping
    (the gateway's :class:`services.rpc.auth.AuthInterceptor`): a domain error they
    raise gets its status code. ``public`` (the gateway): error texts sent to clients
    name no internal address (:func:`services.rpc.status.public_message`; the whole
    text is logged). The port speaks TLS (mTLS with a client CA) when the
    settings name a certificate (:mod:`services.rpc.tls`), plaintext otherwise.
    """
    max_bytes = settings.max_message_mb * 1024 * 1024
    if admission is None:
        admission = Admission(
            settings.max_in_flight, settings.retry_after_ms, client_share=settings.client_share
        )
    server = grpc.aio.server(
        interceptors=[ErrorAndLatencyInterceptor(metrics, admission, public), *interceptors],
        options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", max_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", settings.streams_per_connection()),
        ],
    )
    names = list(register(server))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    tls = settings.server_tls()
    address = f"{settings.host}:{settings.port}"
    port = (
        server.add_secure_port(address, tls.credentials())
        if tls is not None
        else server.add_insecure_port(address)
    )
    if port == 0:
        raise errors.Unavailable(f"cannot bind {settings.host}:{settings.port}")
    await server.start()
    handle = Server(
        grpc_server=server,
        port=port,
        health=health,
        services=names,
        admission=admission,
        health_server=await _health_only_server(settings, health),
    )
    await handle.set_serving(True)
    if settings.port_file:
        with open(settings.port_file, "w", encoding="utf-8") as fh:
            fh.write(str(port))
    return handle, port


async def _health_only_server(
    settings: ServiceSettings, health: HealthServicer
) -> grpc.aio.Server | None:
    """``settings.health_port``: the same health status, plaintext, on a port of its own
    with nothing else on it (Kubernetes' gRPC probes cannot speak TLS)."""
    if settings.health_port is None:
        return None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if server.add_insecure_port(f"{settings.host}:{settings.health_port}") == 0:
        raise errors.Unavailable(f"cannot bind {settings.host}:{settings.health_port}")
    await server.start()
    return server


async def serve_until_signal(server: Server, grace: float) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully: NOT_SERVING, drain, stop."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(server.grpc_server.wait_for_termination())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("signal received: draining for up to %.1f s", grace)
        await server.stop(grace)
    waiter.cancel()
    stopper.cancel()


class Running(Protocol):
    """A started service: its server, its metrics registry, and how to close it."""

    server: Server
    registry: CollectorRegistry

    async def close(self, grace: float = ...) -> None: ...


async def serve_started(running: Running, settings: ServiceSettings) -> None:
    """Expose the metrics (when a port is set), serve until SIGTERM/SIGINT, close."""
    if settings.metrics_port is not None:
        serve_metrics(running.registry, settings.metrics_port, settings.host)
    try:
        await serve_until_signal(running.server, settings.grace_seconds)
    finally:
        await running.close(0)
